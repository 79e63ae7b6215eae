"""The install layout: one top-level package ``dpgs``; master/ and workers/ install as dpgs.master/workers."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def setuptools_section() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_directory_is_installed():
    """A new sub-package that is not listed in pyproject.toml would be missing from `pip install .`."""
    listed = set(setuptools_section()["packages"])
    on_disk = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "dpgs").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    on_disk |= {"dpgs.master", "dpgs.workers"}
    assert on_disk == listed, f"missing: {sorted(on_disk - listed)}, stale: {sorted(listed - on_disk)}"
    assert all(name == "dpgs" or name.startswith("dpgs.") for name in listed)


def test_roles_install_under_dpgs():
    assert setuptools_section()["package-dir"] == {"dpgs.master": "master", "dpgs.workers": "workers"}
    import dpgs.master
    import dpgs.workers

    assert Path(dpgs.master.__file__).resolve().parent == ROOT / "master"
    assert Path(dpgs.workers.__file__).resolve().parent == ROOT / "workers"


SOURCES = {"dpgs": ROOT / "dpgs", "dpgs.master": ROOT / "master", "dpgs.workers": ROOT / "workers"}


def module_files() -> dict[str, Path]:
    """Every installed module (``dpgs.x.y`` or the package ``dpgs.x``) and its file."""
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The installed modules that ``path`` imports (module level or inside functions): ``from a.b import c``
    counts as ``a.b.c`` when that is a module, else as ``a.b``."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpgs"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dpgs"))
    return found & modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a package's ``__init__`` is the package itself."""
    files = module_files()
    return {module: imports_of(path, set(files)) - {module} for module, path in files.items()}


def imported_modules(package: str) -> set[str]:
    """Every ``dpgs...`` module that the modules of ``package`` import."""
    graph = import_graph()
    return {m for module, deps in graph.items() if module == package or module.startswith(package + ".")
            for m in deps}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle among the installed modules, a package's ``__init__`` included (the import-time
    cycles that package-dir remapping hides from other tools)."""
    assert cycles(import_graph()) == []


def test_no_import_cycles_between_the_layers():
    """The trainer knows engines by protocol only; feature bags know nothing of slides (dpgs.runner and
    dpgs.experiment sit above both); the DPGS driver receives the role classes and never imports them."""
    assert not {m for m in imported_modules("dpgs.train") if m.startswith("dpgs.distributed")}
    assert not {m for m in imported_modules("dpgs.data") if m.startswith("dpgs.wsi")}
    roles = {m for m in imported_modules("dpgs.distributed") if m.startswith(("dpgs.master", "dpgs.workers"))}
    assert not roles


def test_the_sync_scheme_is_asked_nowhere_outside_its_package():
    """The master and the workers call the fold's StepSync; none of them asks which scheme it holds."""
    import re

    offenders = [
        str(path.relative_to(ROOT))
        for module, path in module_files().items()
        if not module.startswith("dpgs.distributed.sync")
        and re.search(r"isinstance\([^)]*(Relay|Delta)Sync", path.read_text())
    ]
    assert offenders == []
