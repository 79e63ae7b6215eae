"""How the ranks of one generation of a DPGS group find each other, and open their channel.

The driver asks the master to host the store (:func:`host_store`, on the master's node; its address comes
back), builds one :class:`Rendezvous` and sends it to every rank; each rank calls :meth:`Rendezvous.open`
with its own rank, the master with the store it hosts.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dpgs.distributed.gloo import GlooChannel
from dpgs.distributed.mailbox import MailboxChannel
from dpgs.distributed.transport import Channel


@dataclass(frozen=True)
class Rendezvous:
    """One generation of the group.

    ``transport`` is ``gloo`` (``address`` = the master's store) or ``ray`` (``mailbox`` = actor handle).
    Joining waits at most ``dpgs.distributed.transport.JOIN_TIMEOUT_S`` for the other ranks; every later
    operation ``timeout_s``.
    """

    transport: str
    generation: int
    world: int
    timeout_s: float
    address: tuple[str, int] | None = None
    mailbox: Any = None

    def open(self, rank: int, store: dist.TCPStore | None = None) -> Channel:
        """This rank's channel; ``store``: the gloo store at ``address`` when this process hosts it (a Ray
        transport has none and leaves it unused)."""
        if self.transport == "gloo":
            return GlooChannel(rank, self.world, self.address, self.timeout_s, store=store)
        return MailboxChannel(rank, self.world, self.mailbox, self.generation, self.timeout_s)


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A rendezvous store served by this process on ``host`` (``store.host``, ``store.port``), which the
    other ranks join as clients within ``timeout_s``.

    The port is the one the operating system gives the listening socket as it binds. (A port found free
    first and listened on later can be taken in between by another socket on the node: CI saw
    ``EADDRINUSE``, and the group fell back to Ray.)"""
    return dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def host_store(timeout_s: float) -> dist.TCPStore:
    """:func:`serve_store` on this process's Ray node's address."""
    import ray

    return serve_store(ray.util.get_node_ip_address(), timeout_s)
