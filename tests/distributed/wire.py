"""An in-memory ``Channel`` for a master and P workers in one process (threads), for tests without Ray.

As the gloo transport needs, both sides of a bounded exchange must give the same bound (each message
travels with its sender's, and the receiver compares it with its own), and a message longer than its
bound is refused; each bounded message is recorded in ``Wire.bounded``."""

from __future__ import annotations

import queue
import time

from dpgs.distributed.transport import check_bound


class Wire:
    """In-memory channels of a master and P workers (the ``Channel`` contract, without faults)."""

    def __init__(self, workers: int):
        self.up = [queue.Queue() for _ in range(workers)]
        self.relayed = [queue.Queue() for _ in range(workers)]
        self.down = [queue.Queue() for _ in range(workers)]
        self.bytes_up = self.bytes_down = 0
        self.bounded: list[tuple[str, int, int]] = []  # ("up" | "down", bytes, bound) of each bounded message

    def send(self, q: queue.Queue, direction: str, body, bound: int | None) -> None:
        check_bound(body, bound)
        if bound is not None:
            self.bounded.append((direction, body.numel(), bound))
        q.put((body.clone(), bound))

    @staticmethod
    def receive(q: queue.Queue, bound: int | None):
        body, sent = q.get(timeout=30)
        assert sent == bound, f"sent with bound {sent}, received with bound {bound}"
        return body

    def master(self):
        wire = self

        class Master:
            rank, world = 0, len(wire.up) + 1

            def gather_up(self, timed: bool = False, forward=None, bound=None):
                assert bound is None or forward is None, "a bounded gather is not relayed"
                bodies, self.arrivals = [], []
                for q in wire.up:
                    bodies.append(wire.receive(q, bound))
                    if timed:
                        self.arrivals.append(time.perf_counter())
                counts = None if forward is None else forward([b.numel() for b in bodies])
                for w, q in enumerate(wire.relayed):
                    heads = [] if counts is None else [b[:n].clone() for o, (b, n) in
                                                       enumerate(zip(bodies, counts, strict=True)) if o != w]
                    wire.bytes_down += sum(h.numel() for h in heads)
                    q.put(heads)
                return bodies

            def send_down(self, body, bound=None):
                for q in wire.down:
                    wire.bytes_down += body.numel()
                    wire.send(q, "down", body, bound)

        return Master()

    def worker(self, w: int):
        wire = self

        class Worker:
            rank, world = w + 1, len(wire.up) + 1

            owed = False  # what the master forwarded of the last message up is not yet taken

            def send_up(self, body, bound=None):
                self.settle()
                wire.bytes_up += body.numel()
                wire.send(wire.up[w], "up", body, bound)
                self.owed = True

            def recv_relayed(self):
                if not self.owed:
                    return []
                self.owed = False
                return wire.relayed[w].get(timeout=30)

            def settle(self):
                assert not self.recv_relayed(), "forwarded heads nobody took"

            def recv_down(self, bound=None):
                self.settle()
                return wire.receive(wire.down[w], bound)

        return Worker()
