"""How the ranks of one generation of a DPGS group find each other, and open their channel.

The driver asks the master for an address (:func:`free_address`, on the master's node), builds one
:class:`Rendezvous` and sends it to every rank; each rank calls :meth:`Rendezvous.open` with its own rank.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

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

    def open(self, rank: int) -> Channel:
        if self.transport == "gloo":
            return GlooChannel(rank, self.world, self.address, self.timeout_s)
        return MailboxChannel(rank, self.world, self.mailbox, self.generation, self.timeout_s)


def free_address() -> tuple[str, int]:
    """This node's Ray address and a TCP port that is free on it now (a rendezvous point)."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]
