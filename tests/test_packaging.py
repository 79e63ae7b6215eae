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
