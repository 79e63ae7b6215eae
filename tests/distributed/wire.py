"""An in-memory ``Channel`` for a master and P workers in one process (threads), for tests without Ray."""

from __future__ import annotations

import queue
import time


class Wire:
    """In-memory channels of a master and P workers (the ``Channel`` contract, without faults)."""

    def __init__(self, workers: int):
        self.up = [queue.Queue() for _ in range(workers)]
        self.relayed = [queue.Queue() for _ in range(workers)]
        self.down = [queue.Queue() for _ in range(workers)]
        self.bytes_up = self.bytes_down = 0

    def master(self):
        wire = self

        class Master:
            rank, world = 0, len(wire.up) + 1

            def gather_up(self, timed: bool = False, forward=None):
                bodies, self.arrivals = [], []
                for q in wire.up:
                    bodies.append(q.get(timeout=30))
                    if timed:
                        self.arrivals.append(time.perf_counter())
                counts = None if forward is None else forward([b.numel() for b in bodies])
                for w, q in enumerate(wire.relayed):
                    heads = [] if counts is None else [b[:n].clone() for o, (b, n) in
                                                       enumerate(zip(bodies, counts, strict=True)) if o != w]
                    wire.bytes_down += sum(h.numel() for h in heads)
                    q.put(heads)
                return bodies

            def send_down(self, body):
                for q in wire.down:
                    wire.bytes_down += body.numel()
                    q.put(body.clone())

        return Master()

    def worker(self, w: int):
        wire = self

        class Worker:
            rank, world = w + 1, len(wire.up) + 1

            owed = False  # what the master forwarded of the last message up is not yet taken

            def send_up(self, body):
                self.settle()
                wire.bytes_up += body.numel()
                wire.up[w].put(body.clone())
                self.owed = True

            def recv_relayed(self):
                if not self.owed:
                    return []
                self.owed = False
                return wire.relayed[w].get(timeout=30)

            def settle(self):
                assert not self.recv_relayed(), "forwarded heads nobody took"

            def recv_down(self):
                self.settle()
                return wire.down[w].get(timeout=30)

        return Worker()
