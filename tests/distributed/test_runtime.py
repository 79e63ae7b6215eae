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
