"""``make image-test``: build docker/Dockerfile from this checkout and a local wheel folder, and train in it.

Steps (as root; ``python -m tests.image``):

1. ``docker.io`` and ``debootstrap`` from apt when missing (a refusal naming the apt error otherwise);
2. a private dockerd (:mod:`tests.image.dockerd`) whose data root is ``STORE/docker``, so the images and
   the build cache of one run serve the next;
3. the base image ``dpgs-base:bookworm`` from ``STORE/base/debian-bookworm-minbase.tar``
   (:mod:`tests.image.debian_base`; debootstrap runs only when the tarball is missing);
4. the wheel folder ``CACHE/wheels``: ``pip download $TORCH_SPEC`` (torch and its dependencies; pip
   takes torch from its own find-links folder on this machine) when no torch wheel is there;
5. ``docker build --network host -f docker/Dockerfile --build-arg BASE_IMAGE=dpgs-base:bookworm
   --build-arg TORCH_WHEELS=CACHE/wheels`` from the repository root (timed; log ``STORE/build.log``);
6. in a container with no network, from the image's WORKDIR (a copy of the checkout, the case that
   broke Ray workers): ``dpgs --version``, ``import dpgs, dpgs.master, dpgs.workers``, the demo bags
   (``dpgs demo-data``, 300 bags), then one epoch of ``configs/demo.yaml`` (packed, one process) and of
   ``configs/demo-dpgs.yaml`` (DPGS on Ray, 2 workers), each MLflow run checked FINISHED;
7. the image saved to ``STORE/image.tar`` (again only when its id changed), then the daemon is stopped
   and checked gone (no process, no mount), also after a failure or Ctrl-C;
8. ``ray up`` with the docker section of configs/cluster.yaml on a lab of three hosts, each with its
   own dockerd holding the image, then ``dpgs train --address auto`` in the head's container and ``ray
   down`` (:mod:`tests.image.lab_cluster`; ``--no-cluster`` skips it).

The last line is ``image-test: ok, build <s> s, image <MB> MB, train packed <s> s (epoch <s> s), train
dpgs <s> s (epoch <s> s); <image>; ray up in containers <s> s (...), train <s> s, worker actors on
<addresses>, ray down <s> s`` (each run's whole command, and its one epoch with validation), or
``image-test: FAILED: <why>`` (exit 1); ``image-test: refused: <why>`` (exit 2) when it cannot run
here. ``CACHE`` is ``.image-cache`` in the checkout (git-ignored; ``IMAGE_CACHE`` to move it; it must stay
inside the checkout, the build context) and holds only the wheels; ``STORE`` (``IMAGE_STORE``, default
``/var/tmp/dpgs-image-test``) holds the rest, outside the checkout: step 8 runs ``ray up`` from the
checkout, and Ray reads and hashes every file under a ``file_mounts`` source, git-ignored or not (with
the 8 GB of daemon data and image file in the checkout, ``ray up`` spent over 10 minutes hashing).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dpgs
from tests.image.debian_base import ensure_base_image
from tests.image.dockerd import DOCKER, DOCKERD, DockerdError, PrivateDockerd
from tests.image.lab_cluster import run_docker_cluster
from tests.lab.netlab import LabError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {DOCKERD: "docker.io", DOCKER: "docker.io", "/usr/sbin/debootstrap": "debootstrap"}
IMAGE = f"dpgs:{dpgs.__version__}-cpu-local"

# Runs in the container, in the image's WORKDIR, exactly as a user there would type it. Every line the
# host reads starts with "check:".
IN_CONTAINER = r"""
set -euo pipefail
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }
status() {
  python3 - "$1" <<'EOF'
import json, sys
import mlflow
info = json.load(open(sys.argv[1]))
mlflow.set_tracking_uri(info["tracking_uri"])
print(mlflow.get_run(info["run_id"]).info.status)
EOF
}
echo "check: cwd $(pwd)"
echo "check: version $(dpgs --version)"
python3 -c 'import dpgs, dpgs.master, dpgs.workers as w; print("check: imports", dpgs.__file__, w.__file__)'
dpgs demo-data demo_data --bags 300 --seed 0 > /dev/null
for run in packed:configs/demo.yaml dpgs:configs/demo-dpgs.yaml; do
  name=${run%%:*} config=${run#*:}
  start=$(now)
  dpgs train --config "$config" train.epochs=1 train.output_dir="runs/image-$name" 2>&1 | tee "$name.log"
  end=$(now)
  epoch=$(awk '$1 == "time_to_best_seconds" {printf "%.1f", $2}' "$name.log")
  run=$(status "runs/image-$name/run.json")
  echo "check: train $name $(elapsed "$start" "$end") s, epoch $epoch s, run $run"
done
"""


class Refused(RuntimeError):
    """The test cannot run on this machine (not root, no docker.io); the message says why."""


def log(message: str) -> None:
    print(f"image-test: {message}", flush=True)


def ensure_packages() -> None:
    """Install docker.io and debootstrap with apt when their programs are missing."""
    missing = sorted({pkg for path, pkg in PACKAGES.items() if not Path(path).exists()})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise Refused(f"{', '.join(missing)} missing and no apt-get to install them")
    log(f"installing {' '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:  # stale package lists: update once and try again
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or any(not Path(p).exists() for p in PACKAGES):
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise Refused(f"cannot install {' '.join(missing)} (apt-get exit {proc.returncode}: {last})")


def ensure_wheels(folder: Path, torch_spec: str) -> Path:
    """``folder`` with a torch wheel and its dependencies (``pip download`` when no torch wheel is there)."""
    if not any(folder.glob("torch-*.whl")):
        folder.mkdir(parents=True, exist_ok=True)
        log(f"downloading {torch_spec} and its dependencies into {folder}")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", torch_spec, "--dest", str(folder),
                               "--quiet"], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise DockerdError(f"pip download {torch_spec} failed (exit {proc.returncode}): {last}")
    return folder


def build(daemon: PrivateDockerd, base: str, wheels: Path, torch_spec: str, build_log: Path) -> float:
    """Build :data:`IMAGE` from the repository root; returns the seconds it took."""
    log(f"building {IMAGE} (log {build_log})")
    start = time.monotonic()
    try:
        daemon.docker("build", "--progress", "plain", "--network", "host", "-f", "docker/Dockerfile",
                      "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"TORCH_SPEC={torch_spec}",
                      "--build-arg", f"TORCH_WHEELS={wheels.relative_to(ROOT)}", "-t", IMAGE, str(ROOT),
                      log=build_log)
    except DockerdError:
        tail = "\n".join(build_log.read_text(errors="replace").splitlines()[-15:])
        raise DockerdError(f"docker build failed (log {build_log}):\n{tail}") from None
    return time.monotonic() - start


def run_checks(daemon: PrivateDockerd, run_log: Path) -> dict[str, str]:
    """Run :data:`IN_CONTAINER` in a container of :data:`IMAGE`; the ``check:`` lines, by their first word."""
    log(f"checking in a container (log {run_log})")
    name = f"dpgs-image-test-{os.getpid()}"
    try:
        daemon.docker("run", "--rm", "--name", name, "--network", "none", "--shm-size", "4g", IMAGE,
                      "bash", "-c", IN_CONTAINER, log=run_log, timeout=1200)
    except DockerdError:
        tail = "\n".join(run_log.read_text(errors="replace").splitlines()[-15:])
        raise DockerdError(f"the checks in the container failed (log {run_log}):\n{tail}") from None
    checks = {}
    for line in run_log.read_text(errors="replace").splitlines():
        if line.startswith("check: "):
            key, _, rest = line[len("check: "):].partition(" ")
            checks[key if key != "train" else f"train {rest.split()[0]}"] = rest
    return checks


def verify(checks: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``{mode: (seconds of the command, seconds to the end of the epoch's validation)}`` for packed and
    dpgs, after checking the version, the imports and that both MLflow runs FINISHED."""
    version = checks.get("version", "")
    if version != f"dpgs {dpgs.__version__}":
        raise DockerdError(f"dpgs --version in the image: '{version}', expected 'dpgs {dpgs.__version__}'")
    if "imports" not in checks:
        raise DockerdError("the imports did not run in the image")
    seconds = {}
    for mode in ("packed", "dpgs"):
        line = checks.get(f"train {mode}", "")
        match = re.fullmatch(rf"{mode} ([\d.]+) s, epoch ([\d.]+) s, run FINISHED", line)
        if not match:
            raise DockerdError(f"train {mode}: '{line}' (expected a FINISHED run)")
        seconds[mode] = (float(match.group(1)), float(match.group(2)))
    return seconds


def _interrupt(signum, frame) -> None:
    """SIGTERM ends the run as Ctrl-C does: the ``finally`` blocks stop the daemon."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.image", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=os.environ.get("IMAGE_CACHE", str(ROOT / ".image-cache")))
    parser.add_argument("--store", default=os.environ.get("IMAGE_STORE", "/var/tmp/dpgs-image-test"))
    parser.add_argument("--torch-spec", default=os.environ.get("TORCH_SPEC", "torch==2.13.0"))
    parser.add_argument("--no-cluster", action="store_true", help="skip step 8 (ray up in containers)")
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(Path(args.cache).resolve(), Path(args.store).resolve(), args.torch_spec,
                   cluster=not args.no_cluster)
    finally:
        signal.signal(signal.SIGTERM, previous)


def save_image(daemon: PrivateDockerd, file: Path) -> None:
    """``docker save`` :data:`IMAGE` to ``file`` unless it holds this image already (its id beside it)."""
    image_id = daemon.docker("image", "inspect", "-f", "{{.Id}}", IMAGE).stdout.strip()
    stamp = file.with_suffix(".id")
    if file.exists() and stamp.exists() and stamp.read_text() == image_id:
        return
    log(f"saving {IMAGE} to {file}")
    daemon.docker("save", "-o", str(file), IMAGE, timeout=1800)
    stamp.write_text(image_id)


def run(cache: Path, store: Path, torch_spec: str, cluster: bool = True) -> int:
    """Steps 1-8 of the module docstring; the exit status (0 ok, 1 failed, 2 refused)."""
    try:
        if sys.platform != "linux":
            raise Refused("needs Linux")
        if os.geteuid() != 0:
            raise Refused("needs root (it installs docker.io with apt and starts its own dockerd)")
        ensure_packages()
        if not cache.is_relative_to(ROOT):
            raise Refused(f"the cache {cache} (IMAGE_CACHE, --cache) must be inside the checkout {ROOT}: its "
                          "wheel folder is part of the build context")
        wheels = ensure_wheels(cache / "wheels", torch_spec)
        store.mkdir(parents=True, exist_ok=True)
        daemon = PrivateDockerd(store / "docker")
        log(f"starting a private dockerd (data root {daemon.data_root})")
        try:
            with daemon:
                base, how = ensure_base_image(daemon, store / "base" / "debian-bookworm-minbase.tar",
                                              store / "debootstrap.log")
                log(f"base image {base}: {how}")
                build_s = build(daemon, base, wheels, torch_spec, store / "build.log")
                size_mb = int(daemon.docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout) / 1e6
                checks = run_checks(daemon, store / "container.log")
                train_s = verify(checks)
                if cluster:
                    save_image(daemon, store / "image.tar")
        finally:
            left = daemon.leftovers()
            if left:
                log(f"tear-down left: {', '.join(left)}")
        if left:
            raise DockerdError(f"the private dockerd was not torn down: {', '.join(left)}")
        in_containers = ""
        if cluster:
            log("ray up with the docker section, on a lab of three hosts (tests/image/lab_cluster.py)")
            in_containers = "; " + run_docker_cluster(store / "image.tar", IMAGE, log).line()
    except Refused as err:
        log(f"refused: {err}")
        return 2
    except (DockerdError, LabError, subprocess.SubprocessError, OSError) as err:
        log(f"FAILED: {err}")
        return 1
    except KeyboardInterrupt:
        log("FAILED: interrupted (the private dockerd was stopped)")
        return 1
    trains = ", ".join(f"train {mode} {whole:.1f} s (epoch {epoch:.1f} s)"
                       for mode, (whole, epoch) in train_s.items())
    log(f"ok, build {build_s:.0f} s, image {size_mb:.0f} MB, {trains}; {IMAGE}{in_containers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
