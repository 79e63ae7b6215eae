"""dpgs.nodewatch: a worker node's Ray is stopped once its head has been unreachable for the grace period."""

from __future__ import annotations

import socket

from dpgs.nodewatch import watch


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_stops_once_the_head_has_been_unreachable_for_the_grace_period():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    clock, stopped = FakeClock(), []

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now == 20:  # the head goes away after 20 s
            server.close()

    down = watch("127.0.0.1", port, lambda: stopped.append(clock.now), grace_s=30, poll_s=5,
                 clock=clock, sleep=sleep)
    assert stopped == [50.0]  # first seen down at 20 s, still down 30 s later
    assert down == 30.0


def test_a_head_that_comes_back_within_the_grace_period_is_not_stopped():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    clock, stopped, state = FakeClock(), [], {"server": server}

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now == 10:  # down at 10 s (a restart) ...
            state["server"].close()
        if clock.now == 30:  # ... back at 30 s, before the 30 s grace ran out
            state["server"] = socket.create_server(("127.0.0.1", port))
        if clock.now == 60:  # gone for good at 60 s
            state["server"].close()

    watch("127.0.0.1", port, lambda: stopped.append(clock.now), grace_s=30, poll_s=5, clock=clock,
          sleep=sleep)
    assert stopped == [90.0]


def test_only_one_watcher_per_node(tmp_path, monkeypatch):
    import fcntl
    import os

    import dpgs.nodewatch as nodewatch

    monkeypatch.setattr(nodewatch, "LOCK", tmp_path / "lock")
    monkeypatch.setattr(nodewatch, "watch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("watched")))
    held = os.open(tmp_path / "lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a watcher runs already
    assert nodewatch.main(["127.0.0.1:1"]) == 0  # returns at once, without watching
    os.close(held)
