"""Writing a whole output directory atomically: nothing half-done is ever left at the target."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir`` to write into.

    On success it replaces ``out_dir`` (an earlier directory there is removed only after the new one
    is complete); on any error the temporary directory is deleted and ``out_dir`` is untouched.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "previous")
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
