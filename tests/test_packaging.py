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


def imported_modules(package: str) -> set[str]:
    """Every ``dpgs...`` module that the modules of ``package`` import (module level or inside functions)."""
    import ast

    found = set()
    for path in (ROOT / Path(*package.split("."))).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpgs"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("dpgs"))
    return found


def test_no_import_cycles_between_the_layers():
    """The trainer knows engines by protocol only; feature bags know nothing of slides (dpgs.runner and
    dpgs.experiment sit above both)."""
    assert not {m for m in imported_modules("dpgs.train") if m.startswith("dpgs.distributed")}
    assert not {m for m in imported_modules("dpgs.data") if m.startswith("dpgs.wsi")}
