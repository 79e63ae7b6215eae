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
