"""SIGINT and SIGTERM as one exception, so every training mode ends the same way when stopped.

Inside :func:`signals_interrupt` both signals raise :class:`Interrupted` in the main thread; the trainer
marks its MLflow runs KILLED, keeps the checkpoints, releases its engine, and ``dpgs train`` exits with
``128 + signal number`` (130 for SIGINT, 143 for SIGTERM). A second signal during that cleanup ends the
process at once. A signal that the parent set to be ignored stays ignored. Inside
:func:`interrupts_deferred` (an MLflow write: a SQLite transaction cut in the middle leaves the store
locked for the writes that mark the run KILLED) the signal is held and raised when the block ends.

``ray.init`` replaces the driver's SIGTERM handler with one that calls ``sys.exit``; code that may start
Ray runs inside :func:`keep_signal_handlers` so that ours stays in place.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: ``signal_name`` says which, ``exit_code`` is 128 + its number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.signal_name}")


_received: list[int] = []  # signals received inside the current signals_interrupt block
_held: list[int] = []  # a signal that arrived inside interrupts_deferred, raised when it ends
_deferring = [0]  # depth of interrupts_deferred blocks in the main thread


def _raise_interrupted(signum: int, frame) -> None:
    if _received or _held:  # a second signal while cleaning up: end the process at once, by that signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _deferring[0]:
        _held.append(signum)
        return
    _received.append(signum)
    raise Interrupted(signum)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A SIGINT or SIGTERM that arrives inside the block is raised as :class:`Interrupted` when the block
    ends (replacing an exception the block raised), never in its middle. Other threads: no effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
        if not _deferring[0] and _held:
            signum = _held.pop()
            _received.append(signum)
            raise Interrupted(signum)


@contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Restore the SIGINT and SIGTERM handlers on leaving the block (whatever the block installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in HANDLED}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise :class:`Interrupted` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _held.clear()
    with keep_signal_handlers():
        for sig in HANDLED:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, _raise_interrupted)
        yield
