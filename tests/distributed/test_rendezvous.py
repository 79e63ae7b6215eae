"""How a group's ranks meet: the store is listening from the moment its address is handed out, and a
failed join is waited out on every rank before the next one is tried."""

from __future__ import annotations

import datetime
import errno
import socket
import time

import pytest
import torch.distributed as dist

from dpgs.distributed.rendezvous import host_store


def test_the_hosted_store_holds_its_port_from_the_moment_it_is_handed_out():
    """No other socket can take the port between the address's handing out and the join (a port found
    free and listened on later could be: CI once saw the master's store fail with EADDRINUSE)."""
    store = host_store(timeout_s=10.0)
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind((store.host, store.port))
    assert taken.value.errno == errno.EADDRINUSE
    client = dist.TCPStore(store.host, store.port, None, False, timeout=datetime.timedelta(seconds=10))
    client.set("rank1", b"here")
    assert store.get("rank1") == b"here"


@pytest.mark.ray
def test_settle_waits_out_every_call_that_a_first_failure_left_running(ray_cluster):
    import ray
    from ray.exceptions import RayTaskError

    from dpgs.distributed.actors import get_all, settle

    @ray.remote(num_cpus=0)
    def fail_now() -> None:
        raise RuntimeError("cannot listen")

    @ray.remote(num_cpus=0)
    def still_joining(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    refs = [fail_now.remote(), still_joining.remote(3.0)]
    with pytest.raises(RayTaskError, match="cannot listen"):
        get_all(refs, 60.0, "the group")
    assert ray.wait(refs[1:], timeout=0)[0] == []  # the first failure came back; this call is still running
    settle(refs, 60.0)
    assert ray.wait(refs, num_returns=2, timeout=0)[1] == []  # both have ended
    assert ray.get(refs[1]) == 3.0

    late = still_joining.remote(60.0)
    settle([late], 0.5)  # the deadline passes: nothing raised, the call left running
    assert ray.wait([late], timeout=0)[0] == []
    ray.cancel(late, force=True)
