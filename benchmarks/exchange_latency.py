"""A dense step's exchange through dpgs's ``GlooChannel`` on 127.0.0.1: unbounded against bounded.

    python benchmarks/exchange_latency.py [--numel 213000] [--steps 300] [--repeats 3] [--out FILE]

A master and two workers, each its own process with one torch thread, run ``--steps`` dense steps the way
``dpgs.distributed.sync.relay`` does: each worker computes (a busy loop: ``--compute-ms``, the second
worker 1.3x as long, as an imbalance), sends its raw float32 gradient up and waits for the sum; the master
gathers, sums and sends the sum down. The unbounded exchange (first piece, the route, the rest of the
message) is what every step used before bounded exchanges; the bounded one (``bound=``: one preposted gloo
message each way) is what a dense step uses now. Reported: the master's median step and the slow worker's
median exchange (from its send to the sum received), in ms, for each compute time, medians over
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch
from _common import emit, fmt, loopback_channel, machine_line, markdown


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rank(rank: int, ports, numel: int, steps: int, compute_s: float, bounded: bool, results) -> None:
    torch.set_num_threads(1)
    channel = loopback_channel(rank, 3, ports, timeout_s=60.0)
    bound = 4 * numel if bounded else None
    times = []
    if rank == 0:
        for _ in range(steps):
            start = time.perf_counter()
            total = torch.zeros(numel)
            for body in channel.gather_up(bound=bound):
                total += body.view(torch.float32)
            channel.send_down(total.view(torch.uint8), bound)
            times.append(time.perf_counter() - start)
    else:
        gradient = torch.randn(numel)
        for _ in range(steps):
            _busy(compute_s * (1.3 if rank == 1 else 1.0))
            start = time.perf_counter()
            channel.send_up(gradient.view(torch.uint8), bound)
            channel.recv_relayed()
            channel.recv_down(bound)
            times.append(time.perf_counter() - start)
    results.put((rank, statistics.median(times[steps // 10 :])))


def one_run(numel: int, steps: int, compute_s: float, bounded: bool) -> tuple[float, float]:
    """(master's median step, slow worker's median exchange) in seconds."""
    ctx = mp.get_context("spawn")
    results, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, numel, steps, compute_s, bounded, results))
             for r in range(3)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return got[0], got[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=213_000, help="parameters (default: MUSK's ABMIL head)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--compute-ms", default="0,3.5", help="comma-separated (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = []
    for compute_ms in (float(c) for c in args.compute_ms.split(",")):
        medians = {}
        for bounded in (False, True):
            runs = [one_run(args.numel, args.steps, compute_ms / 1000, bounded) for _ in range(args.repeats)]
            medians[bounded] = [statistics.median(r[i] for r in runs) * 1000 for i in (0, 1)]
        for bounded in (False, True):
            step, exchange = medians[bounded]
            rows.append([fmt(compute_ms, ".1f"), "bounded" if bounded else "unbounded", fmt(step, ".2f"),
                         fmt(exchange, ".2f"), fmt(step / medians[False][0], ".2f") + "x"])
    header = ["compute ms (slow worker 1.3x)", "exchange", "master step ms", "slow worker's exchange ms",
              "step vs unbounded"]
    table = markdown(header, rows)
    mb = 4 * args.numel / 1e6
    emit(f"A dense step of {args.numel:,} float32 parameters ({mb:.2f} MB each way), master and 2 workers as "
         f"processes on 127.0.0.1, {args.steps} steps, medians of {args.repeats} runs. "
         f"{machine_line()}.\n\n{table}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
