"""The garbage collector and a long-lived process's start-up heap."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object the process holds to the garbage collector's permanent generation, once per process.

    Called by the driver when the first fold starts and by every DPGS actor once it is built. When the first
    fold starts, the driver holds about half a million objects that live as long as the command: the
    modules, Ray's, MLflow's and SQLAlchemy's state, the dataset's records. A full collection traverses all
    of them: 0.23 s on the 2-core development machine, 0.27-0.30 s on the lab's head, where it fell between
    epochs 3 and 4 of 5 of 6 ten-epoch feature-bag runs (a tenth of their time to target; found with
    ``gc.callbacks``). An actor holds torch's, Ray's and the dataset's objects alike. Frozen, they are never
    traversed again: the collections during training see only what training allocates. Objects are still
    freed when their last reference goes; what freezing keeps is only garbage already in a reference cycle
    at that moment, and that is never collected."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
