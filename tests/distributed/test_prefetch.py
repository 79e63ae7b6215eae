"""``dpgs.distributed.actors.prefetch``: an answer asked for ahead crosses to the driver's node before it is
got (what makes the workers' states travel while the driver validates)."""

from __future__ import annotations

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from dpgs.distributed.actors import prefetch  # noqa: E402


@ray.remote(num_cpus=0)
class Holder:
    def make(self, nbytes: int) -> np.ndarray:
        return np.ones(nbytes, dtype=np.uint8)


def on_nodes(ref) -> set[str]:
    return set(ray.experimental.get_object_locations([ref])[ref]["node_ids"])


def test_prefetch_brings_a_remote_object_to_this_node(ray_cluster):
    here = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False)).remote()
    left, fetched = holder.make.remote(4 << 20), holder.make.remote(4 << 20)
    ray.wait([left, fetched], num_returns=2, fetch_local=False)  # both made on the other node, neither pulled
    assert on_nodes(fetched) == on_nodes(left) == {other}

    prefetch([fetched], timeout_s=30)
    deadline = time.monotonic() + 20
    while here not in on_nodes(fetched) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert here in on_nodes(fetched)
    assert here not in on_nodes(left)  # nothing else moved it
    assert ray.get(fetched).sum() == 4 << 20
    ray.kill(holder)


def test_prefetch_of_a_failed_task_leaves_the_error_to_the_get(ray_cluster):
    @ray.remote(num_cpus=0)
    def fails():
        raise ValueError("no state")

    ref = fails.remote()
    prefetch([ref], timeout_s=30)
    with pytest.raises(ValueError, match="no state"):
        ray.get(ref)
