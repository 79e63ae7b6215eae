"""``ray up`` with the docker section of configs/cluster.yaml, on the lab, in the image just built.

The lab (:mod:`tests.lab.netlab`, its own name :data:`LAB_NAME` so that it never meets ``make
cluster-test``'s) gets a dockerd on the head and on each worker host (``Lab.start_dockerd``: a Docker data
root on this machine's disk, no bridge, no iptables). No registry can be reached from the lab, so the
image is loaded into each host's daemon from a ``docker save`` file, and the user's config says what
docs/cluster.md tells an air-gapped site to change (:func:`docker_lab_config`): the image's local name,
``pull_before_run: false``, and pip pointed at a wheel folder (``setup_commands`` run ``pip install .``
in the container, which needs setuptools). Everything else is the docker section as committed.

Then, as the user on the client host: ``ray up`` (the containers started over ssh, the checkout synced
into them and installed), ``dpgs train --address auto`` in the head's container through ``ray exec``
(DPGS, P=2, one worker actor in each worker host's container, token auth on, MLflow run FINISHED; runs
and the MLflow store on the shared ``/data``), ``ray down``, and every container gone.
"""

from __future__ import annotations

import json
import re
import resource
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.lab.cluster import CONFIG, UserSession, lab_config, mlflow_run, wait_for_nodes, worker_addresses
from tests.lab.netlab import WHEELHOUSE, Lab, LabError, sweep

LAB_NAME = "dpgsimg"
CONTAINER = "dpgs"  # docker.container_name in configs/cluster.yaml
EXIT = "dpgs-exit="


def docker_lab_config(lab: Lab, image: str, source: Path = CONFIG) -> str:
    """``source`` with its docker section, for ``lab``'s hosts: the edits of :func:`lab_config` but the
    deletion of the docker section, plus an air-gapped site's: the image's local name, no pull, pip from
    a wheel folder mounted into the containers."""
    config = yaml.safe_load(source.read_text())
    docker = config["docker"]
    edited = yaml.safe_load(lab_config(lab, source))  # provider, head address, ssh user and key
    edited["docker"] = {
        **docker,
        "image": image,
        "pull_before_run": False,
        "run_options": [*map(within_open_files_limit, docker["run_options"]), "-e PIP_NO_INDEX=1",
                        "-e PIP_FIND_LINKS=/wheels", f"-v {WHEELHOUSE}:/wheels:ro"],
    }
    order = list(config)  # the committed file's order of sections
    return yaml.safe_dump({k: edited[k] for k in order}, sort_keys=False, width=1000)


def within_open_files_limit(option: str) -> str:
    """``option`` (a ``docker run`` option), with ``--ulimit nofile`` lowered to this machine's hard limit
    where a process may not raise it (no CAP_SYS_RESOURCE, as in a container: runc then refuses to start
    the container with "error setting rlimit type 7: operation not permitted")."""
    match = re.fullmatch(r"--ulimit nofile=(\d+):(\d+)", option)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if match is None or hard == resource.RLIM_INFINITY or int(match.group(2)) <= hard:
        return option
    try:  # may this process raise its hard limit? (then so may runc)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard + 1))
    except (ValueError, OSError):
        return f"--ulimit nofile={min(int(match.group(1)), hard)}:{hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return option


def in_containers(lab: Lab, host: str) -> list[str]:
    """Names of the containers running on ``host``."""
    return lab.run(host, ["docker", "ps", "--format", "{{.Names}}"]).stdout.split()


def alive_nodes(user: UserSession) -> dict[str, float]:
    """Alive Ray nodes, asked in the head's container (address -> CPUs)."""
    code = ("import json, ray; ray.init(address='auto', log_to_driver=False); "
            "print('nodes=' + json.dumps({n['NodeManagerAddress']: n['Resources'].get('CPU', 0.0) "
            "for n in ray.nodes() if n['Alive']}))")
    out = user.on_head(f"python3 -c {shlex.quote(code)}", timeout=180, check=False).result.stdout
    found = re.findall(r"nodes=(\{.*\})", out)
    return json.loads(found[-1]) if found else {}


@dataclass
class DockerClusterResult:
    load_s: float
    ray_up_s: float
    nodes_alive_s: float
    train_s: float
    workers: list[str]
    ray_down_s: float

    def line(self) -> str:
        return (f"ray up in containers {self.ray_up_s:.0f} s (3 nodes {self.nodes_alive_s:.0f} s later), "
                f"train {self.train_s:.0f} s, worker actors on {', '.join(self.workers)}, "
                f"ray down {self.ray_down_s:.0f} s")


def load_image(lab: Lab, image_file: Path) -> float:
    """A dockerd on the head and on each worker host, each loading ``image_file``; returns the seconds."""
    start = time.monotonic()
    for host in ["head", *lab.workers]:
        lab.start_dockerd(host)
        lab.run(host, ["docker", "load", "-i", str(image_file)], timeout=900)
    return time.monotonic() - start


def run_docker_cluster(image_file: Path, image: str, log) -> DockerClusterResult:
    """The whole path (module docstring) on a fresh lab, torn down afterwards whatever happens."""
    sweep(LAB_NAME)
    with Lab.up(workers=2, name=LAB_NAME, docker=True) as lab:
        load_s = load_image(lab, image_file)
        log(f"lab {LAB_NAME}: a dockerd on the head and each worker host, {image} loaded in {load_s:.0f} s")
        return user_path(lab, image, load_s, log)


def user_path(lab: Lab, image: str, load_s: float, log) -> DockerClusterResult:
    """docs/cluster.md with Docker, as the user on the lab's client: `ray up`, `dpgs train` in the head's
    container, `ray down`; each checked (module docstring)."""
    nodes = ["head", *lab.workers]
    user = UserSession(lab, docker_lab_config(lab, image), name="lab-cluster-docker.yaml")
    user.make_token()
    if not (lab.data / "demo" / "manifest.csv").exists():
        user.sh("dpgs demo-data /data/demo --bags 200 --seed 0", timeout=600)
    up = user.ray_up(timeout=1500)
    log(f"ray up (docker) took {up.seconds:.0f} s")
    # the head's autoscaler starts the workers after `ray up`
    alive_s = wait_for_nodes(lab, len(nodes), timeout_s=600, hold_s=5, nodes=lambda: alive_nodes(user))
    running = {host: in_containers(lab, host) for host in nodes}
    if any(CONTAINER not in names for names in running.values()):
        raise LabError(f"the {CONTAINER} container is not running on every host: {running}")
    train = user.on_head(
        "cd /opt/dpgs-src && dpgs train --config configs/demo-dpgs.yaml --address auto "
        "--tracking-uri sqlite:////data/mlflow.db data.manifest=/data/demo/manifest.csv "
        "data.features_dir=/data/demo/features train.output_dir=/data/runs/docker "
        f"tracking.run_name=docker dpgs.cpus_per_worker=1 train.epochs=2 eval.bootstrap=0; echo {EXIT}$?",
        timeout=1800, check=False)
    output = train.result.stdout + train.result.stderr
    codes = re.findall(rf"{EXIT}(\d+)", output)
    if codes != ["0"]:
        raise LabError(f"dpgs train in the head's container failed:\n{output[-4000:]}")
    workers = worker_addresses(output)
    expected = sorted(lab.hosts[w].address for w in lab.workers)
    if sorted(workers) != expected:
        raise LabError(f"worker actors on {workers}, expected one on each of {expected}")
    status = mlflow_run(lab.data / "mlflow.db", "docker")["status"]
    if status != "FINISHED":
        raise LabError(f"the MLflow run of the containers' training is {status}")
    down = user.ray_down()
    deadline = time.monotonic() + 120
    while any(in_containers(lab, host) for host in nodes) and time.monotonic() < deadline:
        time.sleep(2)
    left = {host: in_containers(lab, host) for host in nodes}
    if any(left.values()):
        raise LabError(f"containers still running after `ray down`: {left}")
    return DockerClusterResult(load_s, up.seconds, alive_s, train.seconds, workers, down.seconds)
