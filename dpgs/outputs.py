"""Writing outputs safely: atomic file writes, and the lock that gives a run its output directory.

* :func:`write_atomically` writes a file through a temporary sibling (``.{name}.tmp-{pid}``), flushes it
  to disk and renames it over the target with ``os.replace``: a reader, a kill or a full disk sees the
  previous file or the new one, never a truncated one. A failed write removes the temporary file and
  raises ``OSError`` naming the target; a process killed mid-write leaves an orphaned temporary file,
  which :func:`remove_temporaries` deletes the next time the directory is used.
* :func:`locked_output_dir` creates a run's output directory and holds an exclusive lock on
  ``.dpgs.lock`` inside it (``flock``, released by the kernel even when the process is killed), so a
  second run into the same directory is refused with the owner's pid and host instead of mixing
  checkpoints.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpgs.errors import RunFailure
from dpgs.interrupts import interrupts_deferred

LOCK_NAME = ".dpgs.lock"
TEMPORARY_PATTERNS = (".*.tmp-*", "checkpoint.pt.tmp")  # ours, and the DPGS master's checkpoint writer


class OutputDirError(RunFailure):
    """``train.output_dir`` cannot be used: not a directory, not writable, or held by another run."""

    exit_code = 2


def temporary_path(path: Path) -> Path:
    """The hidden sibling that :func:`write_atomically` writes ``path`` through."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` to write a temporary sibling of ``path``, then rename it over ``path``.

    ``path`` is replaced only by a complete, flushed file. Any error removes the temporary file; an
    ``OSError`` (full disk, permissions) is raised again naming ``path``. A SIGINT or SIGTERM during the
    write is raised once the file is in place (``interrupts_deferred``): raised inside ``torch.save`` it
    left torch's zip writer half done, and its ``RuntimeError`` replaced the interrupt (exit 1, not 143).
    """
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with interrupts_deferred():
            write(tmp)
            _fsync(tmp)
            os.replace(tmp, path)
    except OSError as err:
        reason = f"cannot write {path}: {err.strerror or err} (any previous {path.name} is unchanged)"
        raise (OSError(reason) if err.errno is None else OSError(err.errno, reason)) from err
    finally:
        tmp.unlink(missing_ok=True)
    try:
        _fsync(path.parent)  # the rename itself survives a crash
    except OSError:
        pass  # some file systems cannot fsync a directory; the file is complete either way
    return path


def write_text_atomically(path: str | Path, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text))


def save_torch_atomically(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (loadable with ``torch.load(path, weights_only=True)``).

    The file is written through a Python file object, so a full disk raises ``OSError`` (torch's own
    writer would raise a ``RuntimeError`` that does not say why).
    """
    import torch

    def write(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            torch.save(obj, fh)

    return write_atomically(path, write)


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporary files that a killed writer left in ``directory``; returns them.

    Call it only while holding the directory's lock (:func:`locked_output_dir`): then no other process
    is writing there.
    """
    directory = Path(directory)
    removed = []
    for pattern in TEMPORARY_PATTERNS:
        for path in directory.glob(pattern):
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _owner_of(lock: Path) -> str:
    try:
        owner = json.loads(lock.read_text())
        return f"pid {owner['pid']} on host {owner['host']} (since {owner['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its pid is not written yet)"


def _open_directory(path: Path) -> bool:
    """Create ``path`` if needed; True when this call created it. OutputDirError when it cannot be used."""
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"train.output_dir={path} is a file, not a directory")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputDirError(f"train.output_dir={path}: cannot create the directory ({err})") from None
    return created


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty: the run wrote its outputs


def _acquire(lock: Path) -> int:
    """An open descriptor of ``lock`` holding its exclusive flock (the file is the one at that path)."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise OutputDirError(
                f"train.output_dir={lock.parent} is not writable ({err.strerror}): choose another directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputDirError(
                f"train.output_dir={lock.parent} is in use by another dpgs run: {_owner_of(lock)}. Wait for "
                "it to finish, stop it, or choose another train.output_dir"
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                os.close(fd)
                raise
            print(f"[dpgs] warning: {lock.parent} does not support file locks; two runs into it would not "
                  "be refused", file=sys.stderr)
            return fd
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the previous owner removed the file between our open and our lock: try again


@contextmanager
def locked_output_dir(path: str | Path) -> Iterator[Path]:
    """Create ``path`` and hold its lock for the block; OutputDirError (exit code 2) when the directory
    is a file, cannot be created or written, or another dpgs process holds it (pid and host named).

    On exit the lock file is removed, and a directory this call created is removed again if it is still
    empty (a run refused before writing anything leaves nothing behind).
    """
    path = Path(path)
    created = _open_directory(path)
    lock = path / LOCK_NAME
    try:
        fd = _acquire(lock)
    except BaseException:
        if created:
            _remove_if_empty(path)
        raise
    try:
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(owner).encode())
        yield path
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
        if created:
            _remove_if_empty(path)
