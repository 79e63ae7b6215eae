"""Run a function on G gloo ranks in local processes (``torch.multiprocessing.spawn``)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` gloo ranks; an assertion in any rank fails the caller."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, fn, args), nprocs=world, join=True)
