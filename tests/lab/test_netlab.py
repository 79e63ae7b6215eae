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


def test_without_netem_each_host_delays_what_it_receives_by_both_links_delays():
    """worker1's link delayed 1 ms, worker2's 0.5 ms: the head waits 1 ms for worker1's packets and 0.5 ms
    for worker2's, worker1 waits 1.5 ms for worker2's (two delayed links) and 1 ms for anyone else's."""
    lab = fake_lab()
    lab.links["worker1"] = netlab.Link(delay_ms=1.0)
    lab.links["worker2"] = netlab.Link(delay_ms=0.5)
    queues = {h: {(q.source, q.delay_ms) for q in lab._delay_queues(h)} for h in lab.hosts}
    w1, w2 = netlab.host_address("worker1"), netlab.host_address("worker2")
    client, head = netlab.host_address("client"), netlab.host_address("head")
    assert queues["head"] == queues["client"] == {(w1, 1.0), (w2, 0.5)}
    assert queues["worker1"] == {(client, 1.0), (head, 1.0), (w2, 1.5)}
    assert queues["worker2"] == {(client, 0.5), (head, 0.5), (w1, 1.5)}
    assert len({q.number for q in lab._delay_queues("worker1")}) == 3  # a queue per source


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


def test_the_docker_lab_config_keeps_the_docker_section_with_an_air_gapped_sites_edits(monkeypatch):
    from tests.image import lab_cluster

    monkeypatch.setattr(lab_cluster, "within_open_files_limit", lambda option: option)  # a real host's
    made = yaml.safe_load(lab_cluster.docker_lab_config(fake_lab(), "dpgs:local"))
    original = yaml.safe_load(CONFIG.read_text())
    without = yaml.safe_load(lab_config(fake_lab()))
    assert list(made) == list(original)  # the committed file's sections, in its order
    assert {k: v for k, v in made.items() if k != "docker"} == without
    extra = ["-e PIP_NO_INDEX=1", "-e PIP_FIND_LINKS=/wheels", f"-v {netlab.WHEELHOUSE}:/wheels:ro"]
    assert made["docker"] == {**original["docker"], "image": "dpgs:local", "pull_before_run": False,
                              "run_options": [*original["docker"]["run_options"], *extra]}
    validate_config(prepare_config(made))


def test_the_open_files_limit_is_lowered_only_where_it_cannot_be_raised(monkeypatch):
    from tests.image import lab_cluster

    limits = {"hard": 20000}
    monkeypatch.setattr(lab_cluster.resource, "getrlimit", lambda which: (1024, limits["hard"]))

    def refuse(which, values):
        if values[1] > limits["hard"]:
            raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(lab_cluster.resource, "setrlimit", refuse)
    assert lab_cluster.within_open_files_limit("--ulimit nofile=65536:65536") == "--ulimit nofile=20000:20000"
    assert lab_cluster.within_open_files_limit("--shm-size=32g") == "--shm-size=32g"
    monkeypatch.setattr(lab_cluster.resource, "setrlimit", lambda which, values: None)  # CAP_SYS_RESOURCE
    assert lab_cluster.within_open_files_limit("--ulimit nofile=65536:65536") == "--ulimit nofile=65536:65536"


def test_docker_hosts_mount_this_machines_cgroup_hierarchies():
    mountinfo = "\n".join([
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755",
        "36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices",
        "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd",
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
        "50 23 0:40 / /proc rw - proc proc rw",
    ])
    assert netlab.cgroup_mounts_script(mountinfo).splitlines() == [
        'mkdir -p "$M/sys/fs/cgroup/devices" && mount -t cgroup -o devices cgroup "$M/sys/fs/cgroup/devices"',
        'mkdir -p "$M/sys/fs/cgroup/systemd" && mount -t cgroup -o name=systemd cgroup '
        '"$M/sys/fs/cgroup/systemd"',
        'mkdir -p "$M/sys/fs/cgroup/unified" && mount -t cgroup2 cgroup2 "$M/sys/fs/cgroup/unified"',
    ]
    with pytest.raises(LabError, match="unexpected cgroup mount"):
        netlab.cgroup_mounts_script("36 31 0:33 / /sys/fs/cgroup/a$(x) rw - cgroup cgroup rw,devices")


def test_a_checkout_or_venv_in_a_folder_the_hosts_replace_is_overlaid_there():
    """A fresh clone in /tmp: every host has its own /tmp, so its client host saw no checkout and no dpgs;
    each host gets its own writable view (``pip install .`` into the venv stays the host's)."""
    script = netlab.shown_folders_script([Path("/tmp/clone"), Path("/tmp/clone/.venv"), Path("/work/main")])
    assert script.splitlines() == [
        'mkdir -p "$L/shown0"/upper "$L/shown0"/work "$M"/tmp/clone && mount -t overlay shown0 '
        '-o "lowerdir="/tmp/clone",upperdir=$L/shown0/upper,workdir=$L/shown0/work" "$M"/tmp/clone'
    ]
    assert netlab.shown_folders_script([Path("/work/main"), Path("/opt/venv")]) == ""
