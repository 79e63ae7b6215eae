"""What the DPGS driver knows of the master and worker roles (``master/``, ``workers/``): the methods it
calls on their actors, and how a worker class is started. The driver receives the role classes
(:class:`Roles`, built by ``dpgs.runner``) and never imports them, so the roles sit on top of
``dpgs.distributed`` and import it, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from dpgs.config import Config


@dataclass(frozen=True)
class WorkerLaunch:
    """How the driver starts the P actors of a worker class.

    ``cpus``/``gpus``: each actor's reservation; ``placed``: one placement-group bundle per actor (False
    for a worker that reserves the resources of its own ranks); ``kwargs``: extra constructor arguments
    of worker w (``kwargs[w]``); ``threads``: the torch thread count the master matches (bit-identical
    replica optimizer steps need the same count on every rank); ``device``: the workers' device;
    ``reservation_prefix``: the name prefix of placement groups the workers reserve themselves (the
    driver releases what dead workers left under it).
    """

    cpus: float
    gpus: float
    placed: bool
    threads: int
    device: str
    kwargs: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    reservation_prefix: str = ""


class WorkerRole(Protocol):
    """A worker class (``workers.Worker`` and its variants): started with :meth:`launch`, its actors answer
    the methods of ``workers.Worker`` (``where``, ``join``, ``start_fold``, ``resync``, ``run_chunk``,
    ``evaluate``, ``sync_state``, ``load_sync_state``, ``replica_state``, ``ping``, ``close``)."""

    @classmethod
    def launch(cls, config: Config) -> WorkerLaunch:
        """The resources and arguments of this class's P actors on the connected cluster."""


@dataclass(frozen=True)
class Roles:
    """The classes the driver starts as the master actor and the worker actors."""

    master: type
    worker: type[WorkerRole]
