"""The gloo transport (``dpgs.distributed.gloo``) between real processes on 127.0.0.1, without Ray: the
step's messages arrive whole and in worker order, and the link probe's timed gather completes (a gloo
receive completes only inside ``wait``)."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from dpgs.distributed.gloo import GlooChannel
from dpgs.distributed.link_probe import probe_as_master, probe_as_worker

WORLD = 3
SIZES = (1 << 10, 1 << 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, results) -> None:
    channel = GlooChannel(rank, WORLD, ("127.0.0.1", port), timeout_s=60.0)
    if rank == 0:
        bodies = channel.gather_up()
        channel.send_down(torch.arange(5, dtype=torch.uint8))
        probe = probe_as_master(channel, SIZES)
        results.put(("master", [b.tolist() for b in bodies], probe))
    else:
        channel.send_up(torch.full((rank * 3,), rank, dtype=torch.uint8))
        down = channel.recv_down()
        probe_as_worker(channel, SIZES)
        results.put((f"worker{rank}", down.tolist(), None))


@pytest.mark.timeout(180)
def test_messages_and_a_link_probe_over_gloo_between_processes():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict((name, (a, b)) for name, a, b in (results.get(timeout=150) for _ in range(WORLD)))
    for p in procs:
        p.join(timeout=30)
    bodies, probe = got["master"]
    assert bodies == [[1, 1, 1], [2, 2, 2, 2, 2, 2]]  # in worker order
    assert got["worker1"][0] == got["worker2"][0] == [0, 1, 2, 3, 4]
    assert probe.sizes == SIZES and probe.workers == 2
    assert all(0 < t < 30 for round_trips in probe.seconds for t in round_trips)


def test_a_join_that_cannot_complete_frees_the_rank_within_the_join_deadline(monkeypatch):
    """A worker whose master never forms the group (gloo bound to the wrong address, a firewall) used to
    stay blocked for the whole exchange deadline (dpgs.call_timeout_s, 600 s by default), so the Ray
    transport that the driver falls back to found it busy and timed out."""
    import threading
    import time

    import torch.distributed as dist

    from dpgs.distributed import gloo
    from dpgs.distributed.transport import ChannelBroken

    monkeypatch.setattr(gloo, "JOIN_TIMEOUT_S", 3.0)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)  # a master that never joins
    start = time.monotonic()
    err: list = []

    def join() -> None:
        try:
            GlooChannel(1, 2, ("127.0.0.1", port), timeout_s=600)
        except ChannelBroken as e:
            err.append(e)

    t = threading.Thread(target=join)
    t.start()
    t.join(60)
    took = time.monotonic() - start
    del store
    assert err and "cannot join the gloo group" in str(err[0])
    assert took < 3.0 + 10, took


def test_local_address_is_the_route_to_the_peer_outside_ray():
    from dpgs.distributed.gloo import local_address

    assert local_address("127.0.0.1") == "127.0.0.1"
