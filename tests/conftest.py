"""Shared fixtures. The Ray cluster is started once per test session (two real nodes on this machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster (``ray.cluster_utils.Cluster``), connected, shared by all Ray tests."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": 150 << 20},
    )
    cluster.add_node(num_cpus=2, object_store_memory=150 << 20)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
