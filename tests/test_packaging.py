"""The install layout: one top-level package ``dpgs``; master/ and workers/ install as dpgs.master/workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

from tests.dpgs_helpers import write_bags

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


def regular_install(tmp_path: Path) -> Path:
    """``pip install .`` (not editable) of this checkout into a fresh virtual environment; returns its bin/.

    Fast: the sources are copied aside (the build writes nothing into the checkout), nothing is downloaded
    (``--no-deps --no-build-isolation``) and the dependencies come from this test's environment through a
    ``.pth`` line (a plain path: the editable install's finder in that environment is not activated).
    """
    src = tmp_path / "src"
    for name in ("dpgs", "master", "workers"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps-of-the-test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
           "--no-build-isolation", "--no-cache-dir", str(src)]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    return venv / "bin"


@pytest.mark.ray
def test_a_regular_install_trains_in_dpgs_mode_from_the_checkout(tmp_path):
    """Ray puts the driver's working directory on the workers' sys.path, so a run started in the checkout
    imports the checkout's ``dpgs`` in its workers, not the installed one: that package must find its
    ``dpgs.master`` and ``dpgs.workers`` (the top-level master/ and workers/ folders) too."""
    bin_dir = regular_install(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    where = subprocess.run([bin_dir / "python", "-c", "import dpgs.workers, dpgs; print(dpgs.__file__)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout
    assert Path(where.strip()).is_relative_to(tmp_path / "venv"), where  # the regular install, not ROOT
    manifest, feats = write_bags(tmp_path / "data", [5, 9, 3, 7, 6, 2, 8, 4, 5, 6])
    cmd = [bin_dir / "dpgs", "train", f"data.manifest={manifest}", f"data.features_dir={feats}",
           "train.mode=dpgs", "dpgs.workers=2", "train.epochs=1", "train.batch_size=4", "eval.bootstrap=0",
           "eval.sample_k=null", f"train.output_dir={tmp_path / 'run'}",
           f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "MLflow run id:" in result.stdout
    assert (tmp_path / "run" / "best.pt").is_file()
