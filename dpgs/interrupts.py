"""SIGINT and SIGTERM as one exception, so every training mode ends the same way when stopped.

Inside :func:`signals_interrupt` both signals raise :class:`Interrupted` in the main thread; the trainer
marks its MLflow runs KILLED, keeps the checkpoints, releases its engine, and ``dpgs train`` exits with
``128 + signal number`` (130 for SIGINT, 143 for SIGTERM). A second signal during that cleanup ends the
process at once. A signal that the parent set to be ignored stays ignored. Inside
:func:`interrupts_deferred` (an MLflow write: a SQLite transaction cut in the middle leaves the store
locked for the writes that mark the run KILLED) the signal is held and raised when the block ends.

A signal never raises inside the standard library's thread-synchronisation code (the modules in
``LOCK_CODE_MODULES``: ``threading``, ``queue``, ``concurrent.futures``, ...). Raised there, between a
lock's acquisition and the ``with`` or ``try`` that releases it (``threading.Condition.__enter__`` is
such a place), it leaves the lock held for ever, and the next thread to take it hangs: a signal that
landed in a ``ThreadPoolExecutor``'s bookkeeping left its semaphore's lock held, the MLflow writer thread
blocked on it, and the cleanup waited for that thread without end (seen once in CI, 2026-11-29; in a loop
of semaphore calls signalled 200 times, 17 locks were left held and 23 released twice). Such a signal
awaits its *safe point*: a re-check thread sends it to the main thread again every ``RECHECK_S`` until
the handler finds the main thread outside that code (a blocking wait there, such as a
``Future.result()``, ends first), and raises it then. A signal still awaiting when
:func:`signals_interrupt` ends is raised at its end.

``ray.init`` replaces the driver's SIGTERM handler with one that calls ``sys.exit``; code that may start
Ray runs inside :func:`keep_signal_handlers` so that ours stays in place.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)
LOCK_CODE_MODULES = (
    "threading",
    "queue",
    "concurrent.futures",
    "logging",
    "multiprocessing",
    "importlib._bootstrap",
    "importlib._bootstrap_external",
)
RECHECK_S = 0.005


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: ``signal_name`` says which, ``exit_code`` is 128 + its number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.signal_name}")


def in_lock_code(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the one a signal interrupted) runs in one of ``LOCK_CODE_MODULES``."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return any(name == module or name.startswith(module + ".") for module in LOCK_CODE_MODULES)


class SafePointRecheck:
    """A daemon thread that sends the signal awaiting its safe point to the main thread again,
    ``RECHECK_S`` after each :meth:`request`, while one awaits (``_awaiting``).

    :meth:`request` is called from the signal handler, so it takes no lock that the interrupted code could
    hold: it writes one byte to a pipe that the thread reads. ``resent`` tells the handler that the signal
    it answers is such a re-send, not a second signal from outside. ``lock`` orders a re-send against
    the end of a :func:`signals_interrupt` block, which stops them before it restores the handlers.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.resent = False
        self._thread: threading.Thread | None = None
        self._wake_fd = -1

    def start(self) -> None:
        """Start the thread unless it runs (a forked child has none)."""
        if self._thread is not None and self._thread.is_alive():
            return
        read_fd, self._wake_fd = os.pipe()
        self._thread = threading.Thread(
            target=self._run, args=(read_fd,), name="dpgs-signal-recheck", daemon=True
        )
        self._thread.start()

    def request(self) -> None:
        os.write(self._wake_fd, b"\0")

    def _run(self, read_fd: int) -> None:
        while os.read(read_fd, 1):
            time.sleep(RECHECK_S)
            with self.lock:
                if _awaiting:
                    self.resent = True
                    signal.pthread_kill(threading.main_thread().ident, _awaiting[0])


_received: list[int] = []  # signals received inside the current signals_interrupt block
_held: list[int] = []  # a signal that arrived inside interrupts_deferred, raised when it ends
_awaiting: list[int] = []  # a signal that arrived in lock code, raised at the main thread's next safe point
_deferring = [0]  # depth of interrupts_deferred blocks in the main thread
_recheck = SafePointRecheck()


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    if _recheck.resent:  # the signal awaiting its safe point, sent again by the re-check thread
        _recheck.resent = False
        if not _awaiting:  # raised meanwhile at the end of its signals_interrupt block
            return
        signum = _awaiting.pop()
    elif _received or _held or _awaiting:  # a second signal: end the process at once, by that signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _deferring[0]:
        _held.append(signum)
        return
    if in_lock_code(frame):
        _awaiting.append(signum)
        _recheck.request()
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
    """Within the block SIGINT and SIGTERM raise :class:`Interrupted` (main thread only), never inside
    lock code (the module docstring); one still awaiting its safe point when the block ends is raised
    at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _held.clear()
    _awaiting.clear()
    _recheck.resent = False  # a re-send answered after an earlier block ended
    _recheck.start()
    with keep_signal_handlers():
        for sig in HANDLED:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, _raise_interrupted)
        try:
            yield
        finally:
            with _recheck.lock:  # no re-send from here on
                awaiting = _awaiting[:]
                _awaiting.clear()
        if awaiting:
            _received.append(awaiting[0])
            raise Interrupted(awaiting[0])
