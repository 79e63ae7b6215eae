"""Cluster-launcher configs against Ray's own schema; one set of install commands everywhere.

The install commands are the block between ``<!-- install-commands -->`` and ``<!-- /install-commands -->``
in README.md (docs/cluster.md while the README has no such block). docker/Dockerfile and the configs'
``setup_commands`` must run exactly those ``python3 -m pip`` commands, in the same order.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from jsonschema import ValidationError
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import start as ray_start

from dpgs.distributed.runtime import RAY_NODE_ENV

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["cluster.yaml", "cluster-aws.yaml"]
BLOCK = re.compile(
    r"<!-- install-commands -->\s*```(?:bash|sh)?\n(.*?)```\s*<!-- /install-commands -->", re.S
)


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def install_block() -> tuple[Path, str]:
    for path in (ROOT / "README.md", ROOT / "docs" / "cluster.md"):
        match = BLOCK.search(path.read_text())
        if match:
            return path, match.group(1)
    raise AssertionError("no <!-- install-commands --> block in README.md or docs/cluster.md")


def commands(lines: list[str]) -> list[list[str]]:
    """Shell commands (split on ';' and '&&', comments dropped) as token lists."""
    out = []
    for line in lines:
        for part in re.split(r"&&|;", line):
            tokens = shlex.split(part, comments=True)
            if tokens:
                out.append(tokens)
    return out


def pip_commands(lines: list[str]) -> list[list[str]]:
    return [c for c in commands(lines) if c[:3] == ["python3", "-m", "pip"]]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [tuple(ln.strip().split(None, 1)) for ln in joined.splitlines() if ln.strip()]


def docker_args() -> dict[str, str]:
    args = {}
    for op, rest in dockerfile():
        if op == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def exports(block: str) -> dict[str, str]:
    return dict(c[1].split("=", 1) for c in commands(block.splitlines()) if c[0] == "export" and "=" in c[1])


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates_against_ray_schema(name):
    config = load(name)
    prepared = prepare_config(config)  # what `ray up` does before validating (defaults, node types)
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", CONFIGS)
def test_typos_are_rejected_by_the_schema(name):
    config = load(name)
    config["setup_command"] = config.pop("setup_commands")
    with pytest.raises(ValidationError, match="setup_command"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_start_commands_parse_and_keep_the_dashboard_local(name):
    config = load(name)
    for key, head in (("head_start_ray_commands", True), ("worker_start_ray_commands", False)):
        starts = [c for c in commands(config[key]) if c[:2] == ["ray", "start"]]
        assert len(starts) == 1, key
        params = ray_start.make_context("start", starts[0][2:]).params  # unknown flags raise here
        assert params["head"] is head
        if head:
            assert params["dashboard_host"] == "127.0.0.1" and params["port"] == 6379
        else:
            assert params["address"] == "$RAY_HEAD_IP:6379"


@pytest.mark.parametrize("name", CONFIGS)
def test_docker_shm_token_auth_and_images(name):
    config = load(name)
    options = " ".join(config["docker"]["run_options"])
    shm = re.search(r"--shm-size=(\d+)g", options)
    assert shm and int(shm.group(1)) >= 8  # Ray's object store lives in /dev/shm
    assert "-e RAY_AUTH_MODE=token" in options
    # the token reaches every node (container) at Ray's default place, where every Ray process reads it
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.dpgs/ray-auth/token"
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert "ray get-auth-token --generate > ~/.dpgs/ray-auth/token" in docs
    images = {v for k, v in config["docker"].items() if k.endswith("image")}
    assert images and all(f"docker push {image}" in docs for image in images)
    assert config["file_mounts"]["/opt/dpgs-src"] == "."


@pytest.mark.parametrize("name", CONFIGS)
def test_every_node_starts_ray_with_dpgs_node_settings(name):
    """Head and workers export RAY_NODE_ENV before `ray start` (a raylet reads RAY_* settings when it
    starts): without the pull timeout, an object slower than 10 s on a link crosses it twice."""
    config = load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        exported: dict[str, str] = {}
        for c in commands(config[key]):
            if c[:2] == ["ray", "start"]:
                break
            if c[0] == "export":
                exported.update(a.split("=", 1) for a in c[1:] if "=" in a)
        assert {k: exported.get(k) for k in RAY_NODE_ENV} == RAY_NODE_ENV, key


def start_params(config: dict, key: str) -> dict:
    (start,) = [c for c in commands(config[key]) if c[:2] == ["ray", "start"]]
    return ray_start.make_context("start", start[2:]).params


def test_on_premise_config_starts_without_docker():
    """What `ray up` without the docker section needs (issue 21, found on the lab): token auth and the
    autoscaler v1 set by the start commands themselves, the head's address given (no default route: Ray
    would advertise 127.0.0.1), no bag workers on the head, and worker nodes that stop with their head."""
    config = load("cluster.yaml")
    head, workers = config["head_start_ray_commands"], config["worker_start_ray_commands"]
    assert all("export RAY_AUTH_MODE=token" in " ".join(cmds) for cmds in (head, workers))
    assert "RAY_enable_autoscaler_v2=0" in " ".join(head)
    params = start_params(config, "head_start_ray_commands")
    assert params["node_ip_address"] == config["provider"]["head_ip"] == "HEAD_IP"
    assert params["num_cpus"] == 0
    watcher = [c for c in commands(workers) if c[:3] == ["nohup", "python3", "-m"]]
    assert watcher and watcher[0][3:5] == ["dpgs.nodewatch", "$RAY_HEAD_IP:6379"]


@pytest.mark.parametrize("name", CONFIGS)
def test_setup_commands_have_a_torch_build_without_the_image(name):
    """Without the image's TORCH_SPEC/TORCH_INDEX_URL the torch install used an empty index URL, which pip
    warns about and skips (exit 0): the setup command falls back to the image's defaults."""
    import subprocess

    (torch_line,) = [c for c in load(name)["setup_commands"] if "$TORCH_SPEC" in c]
    setup = torch_line.split(";")[0]
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", f'{setup}; echo "$TORCH_SPEC $TORCH_INDEX_URL"'], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [docker_args()["TORCH_SPEC"], docker_args()["TORCH_INDEX_URL"]]
    env.update(TORCH_SPEC="torch==9", TORCH_INDEX_URL="https://example.org/simple")  # the image's win
    out = subprocess.run(["bash", "-c", f'{setup}; echo "$TORCH_SPEC $TORCH_INDEX_URL"'], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch==9", "https://example.org/simple"]


def final_stage() -> list[tuple[str, str]]:
    """The steps of the image's own stage (from its ``FROM ${BASE_IMAGE}`` on)."""
    steps = dockerfile()
    return steps[steps.index(("FROM", "${BASE_IMAGE}")):]


def test_dockerfile_builds_cuda_by_default_and_cpu_by_argument():
    steps = dockerfile()
    assert steps[0] == ("ARG", "BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04")
    assert [rest for op, rest in steps if op == "FROM"] == ["scratch AS torch-wheels", "${BASE_IMAGE}"]
    docs = (ROOT / "docs" / "cluster.md").read_text()
    used = set(re.findall(r"--build-arg (\w+)=", docs))
    assert used == {"BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_WHEELS"} and used <= set(docker_args())
    assert docker_args()["TORCH_WHEELS"] == ""  # by default torch comes from TORCH_INDEX_URL
    env = next(rest for op, rest in steps if op == "ENV")
    assert "TORCH_SPEC=${TORCH_SPEC}" in env and "TORCH_INDEX_URL=${TORCH_INDEX_URL}" in env


def test_dockerfile_and_configs_install_like_the_readme():
    source, block = install_block()
    expected = pip_commands(block.splitlines())
    assert [c[3:] for c in expected] == [
        ["install", "--upgrade", "pip"],
        ["install", "$TORCH_SPEC", "--index-url", "$TORCH_INDEX_URL"],  # torch first
        ["install", "."],
    ], source
    runs = [rest for op, rest in dockerfile() if op == "RUN"]
    assert pip_commands(runs) == expected
    for name in CONFIGS:
        assert pip_commands(load(name)["setup_commands"]) == expected, name
    # the same torch pin in the install block, the image and the Makefile
    pins = {exports(block)["TORCH_SPEC"], docker_args()["TORCH_SPEC"]}
    pins.add(re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1))
    assert pins == {"torch==2.13.0"}


def test_local_wheels_are_mounted_never_copied_into_the_image():
    image = final_stage()
    assert not any(op == "COPY" and "torch-wheels" in rest for op, rest in image)
    torch = next(rest for op, rest in image if op == "RUN" and "$TORCH_SPEC" in rest)
    assert torch.startswith("--mount=type=bind,from=torch-wheels,target=/wheels ")
    assert "PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels" in torch  # set only when TORCH_WHEELS is given
    ignored = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".image-cache/base", ".image-cache/docker"} <= set(ignored)


def test_dockerfile_installs_torch_before_copying_dpgs():
    steps = final_stage()
    torch = next(i for i, (op, rest) in enumerate(steps) if op == "RUN" and "$TORCH_SPEC" in rest)
    first_copy = next(i for i, (op, _) in enumerate(steps) if op == "COPY")
    dpgs = next(i for i, (op, rest) in enumerate(steps) if op == "RUN" and rest.endswith("pip install ."))
    assert torch < first_copy < dpgs  # code changes do not invalidate the torch layer
