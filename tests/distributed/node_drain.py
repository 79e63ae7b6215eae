"""A placed actor whose node is drained, restarted by Ray on another node (run as a script: it starts a Ray
cluster of its own, so it cannot share the test session's).

``python -m tests.distributed.node_drain`` prints one JSON line: the bytes the actor held before and
after the restart and the nodes it ran on. The head has no CPUs, so the actor runs on the one worker node;
a second node is added and the first removed gracefully (drained), as an autoscaler or a preempted cloud
host does; Ray then restarts the actor on the second node.
"""

from __future__ import annotations

import json
import os

import ray
from ray.cluster_utils import Cluster

from dpgs.distributed.actors import Bundle, PlacedActors, StartCall

PAYLOAD_BYTES = 150_000  # over Ray's 100 kB limit for arguments sent inside a task


class Holder:
    """Holds what its start call gives it."""

    def __init__(self, index: int):
        self.index = index
        self.data: bytes | None = None

    def take(self, data: bytes) -> None:
        self.data = data

    def held(self) -> int:
        return -1 if self.data is None else len(self.data)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def ping(self) -> int:
        return os.getpid()


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                             "object_store_memory": 80 << 20})
    first = cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=cluster.address)
    try:
        actors = PlacedActors(Holder, 1, lambda i: (i,), bundle=Bundle(1.0), placed=False, max_restarts=1,
                              timeout_s=60.0, start_call=StartCall("take", b"x" * PAYLOAD_BYTES))
        handle = actors.handles[0]
        before = {"held": ray.get(handle.held.remote()), "node": ray.get(handle.node.remote())}
        cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
        cluster.remove_node(first, allow_graceful=True)
        actors.await_restart(0)
        after = {"held": ray.get(handle.held.remote()), "node": ray.get(handle.node.remote())}
        actors.close()
        print(json.dumps({"before": before, "after": after}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
