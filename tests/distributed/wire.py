"""An in-memory ``Channel`` for a master and P workers in one process (threads), for tests without Ray."""

from __future__ import annotations

import queue
import time


class Wire:
    """In-memory channels of a master and P workers (the ``Channel`` contract, without faults)."""

    def __init__(self, workers: int):
        self.up = [queue.Queue() for _ in range(workers)]
        self.down = [queue.Queue() for _ in range(workers)]
        self.bytes_up = self.bytes_down = 0

    def master(self):
        wire = self

        class Master:
            rank, world = 0, len(wire.up) + 1

            def gather_up(self, timed: bool = False):
                bodies, self.arrivals = [], []
                for q in wire.up:
                    bodies.append(q.get(timeout=30))
                    if timed:
                        self.arrivals.append(time.perf_counter())
                return bodies

            def send_down(self, body):
                self.send_each([body] * len(wire.down))

            def send_each(self, bodies):
                assert len(bodies) == len(wire.down)
                for q, body in zip(wire.down, bodies, strict=True):
                    wire.bytes_down += body.numel()
                    q.put(body.clone())

        return Master()

    def worker(self, w: int):
        wire = self

        class Worker:
            rank, world = w + 1, len(wire.up) + 1

            def send_up(self, body):
                wire.bytes_up += body.numel()
                wire.up[w].put(body.clone())

            def recv_down(self):
                return wire.down[w].get(timeout=30)

        return Worker()
