"""Cluster-launcher configs validate against Ray's own schema; the Dockerfile installs like the README."""

import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_cluster_config_validates_against_ray_schema(name):
    config = yaml.safe_load((ROOT / "configs" / name).read_text())
    validate_config(prepare_config(config))
    assert any("--shm-size" in opt for opt in config["docker"]["run_options"])
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=token" in head


def test_broken_cluster_config_is_rejected():
    config = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    config["docker"]["pull_before_run"] = "sometimes"
    with pytest.raises(Exception, match="sometimes"):
        validate_config(config)


def test_dockerfile_installs_torch_first_then_dpgs_like_the_readme():
    docker = (ROOT / "docker" / "Dockerfile").read_text()
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install ([^\\\n&]+)", docker)
    assert installs[1].startswith('"${TORCH_SPEC}"') and installs[2].strip() == "-e ."
    assert "install `torch==2.13.0` first" in readme and "pip install -e .[dev]" in readme
