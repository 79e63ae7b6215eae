"""dpgs.distributed.runtime: sizing the workers from the cluster's nodes."""

from __future__ import annotations

import ray

from dpgs.config.schema import DpgsConfig
from dpgs.distributed import runtime


def cluster(monkeypatch, node_cpus: list[float]) -> None:
    nodes = [{"Alive": True, "Resources": {"CPU": c} if c else {}} for c in node_cpus]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": sum(node_cpus)})


def test_a_head_without_cpus_does_not_size_the_workers(monkeypatch):
    """configs/cluster.yaml starts the head with --num-cpus=0 (no bag workers beside the master): the two
    worker hosts' cores are what the workers share, not min(0, ...) = 0.01 CPU each."""
    cluster(monkeypatch, [0.0, 2.0, 2.0])
    res = runtime.worker_resources(DpgsConfig(workers=2), "cpu")
    assert (res.cpus, res.threads) == (2.0, 2)
    res = runtime.worker_resources(DpgsConfig(workers=4), "cpu")
    assert (res.cpus, res.threads) == (1.0, 1)


def test_a_session_stops_the_ray_it_started_and_leaves_one_it_found(monkeypatch):
    """``connect`` says whether it started (or joined) Ray; the session that did disconnects when it closes,
    at once, not in Ray's exit hook (which first sleeps 0.5 s); Ray that was already there stays."""
    from dpgs.config import load_config
    from dpgs.distributed import session as session_module
    from dpgs.runner import dpgs_roles

    started, shutdowns = [], []
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.append(kwargs) or _Context())
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(runtime.WATCHER, "watch_ray_session", lambda name: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert runtime.connect(DpgsConfig()) is False and not started
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert runtime.connect(DpgsConfig()) is True and started[0]["address"] == "local"

    config = load_config(None, ["train.mode=dpgs"])
    for connected in (True, False):
        shutdowns.clear()
        session = session_module.DpgsSession(config, dpgs_roles(config))
        session.connected = connected  # as ``_start`` records what ``connect`` returned
        session.close()
        assert shutdowns == ([True] if connected else []) and not session.connected


class _Context:
    address_info = {"session_dir": "/tmp/ray/session_test"}
