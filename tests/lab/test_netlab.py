"""The lab's pure parts, in the default suite: refusals, addresses, the config a user makes (no root)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.lab import netlab
from tests.lab.cluster import CONFIG, lab_config
from tests.lab.netlab import Host, Lab, LabError


def fake_lab(workers: int = 2) -> Lab:
    hosts = {h: Host(h, netlab.host_address(h), f"dpgslab-{h}", 0) for h in netlab.host_names(workers)}
    return Lab("dpgslab", Path("/var/tmp/dpgslab"), hosts, Path("/venv"), netem=False)


def test_refuses_clearly_without_root(monkeypatch):
    monkeypatch.setattr(netlab.sys, "platform", "linux")
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="needs root"):
        netlab.check_can_run()


def test_hosts_have_the_labs_own_addresses():
    assert netlab.host_names(3) == ["client", "head", "worker1", "worker2", "worker3"]
    addresses = [netlab.host_address(h) for h in netlab.host_names(3)]
    assert addresses == ["10.213.0.2", "10.213.0.10", "10.213.0.11", "10.213.0.12", "10.213.0.13"]


def test_a_delay_is_refused_without_netem():
    with pytest.raises(LabError, match="netem"):
        fake_lab().link("worker1", delay_ms=5)


def test_the_lab_config_is_cluster_yaml_with_the_edits_docs_cluster_md_asks_for():
    lab = fake_lab()
    made = yaml.safe_load(lab_config(lab))
    original = yaml.safe_load(CONFIG.read_text())
    assert "docker" not in made
    workers = ["10.213.0.11", "10.213.0.12"]
    assert made["provider"] == {"type": "local", "head_ip": "10.213.0.10", "worker_ips": workers}
    assert made["auth"] == {"ssh_user": "root", "ssh_private_key": "/var/tmp/dpgslab/id_ed25519"}
    assert any("--node-ip-address=10.213.0.10 " in c for c in made["head_start_ray_commands"])
    assert [c.replace("HEAD_IP", "10.213.0.10") for c in original["head_start_ray_commands"]] == (
        made["head_start_ray_commands"])
    untouched = set(original) - {"docker", "provider", "auth", "head_start_ray_commands"}
    assert {k: made[k] for k in untouched} == {k: original[k] for k in untouched}
    validate_config(prepare_config(made))
