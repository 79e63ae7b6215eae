"""The Ray mailbox transport (``dpgs.distributed.mailbox``): the heads of the messages up that the master
forwards, each worker receiving the others' and not its own; a message for every worker; the master's abort,
with and without draining the workers' next message up."""

from __future__ import annotations

import pytest
import torch

from dpgs.distributed.transport import ChannelBroken


def message(rank: int) -> torch.Tensor:
    return torch.full((rank + 2,), rank, dtype=torch.uint8)  # rank 1: 3 bytes, rank 2: 4 bytes


def test_relayed_heads_the_shared_message_and_the_abort(ray_cluster):
    from dpgs.distributed.mailbox import Mailbox, MailboxChannel

    mailbox = Mailbox.remote()
    master, *workers = [MailboxChannel(rank, 3, mailbox, generation=0, timeout_s=30) for rank in range(3)]
    for w in workers:
        w.send_up(message(w.rank))
    sizes: list[list[int]] = []
    bodies = master.gather_up(forward=lambda s: sizes.append(s) or [n - 1 for n in s])  # all but 1 byte
    assert sizes == [[3, 4]] and [b.tolist() for b in bodies] == [[1, 1, 1], [2, 2, 2, 2]]
    assert [[h.tolist() for h in w.recv_relayed()] for w in workers] == [[[2, 2, 2]], [[1, 1]]]
    master.send_down(torch.tensor([7, 7, 7], dtype=torch.uint8))
    assert [w.recv_down().tolist() for w in workers] == [[7, 7, 7], [7, 7, 7]]

    for w in workers:  # nothing forwarded: receiving settles the exchange
        w.send_up(message(w.rank))
    master.gather_up(forward=lambda s: None)
    master.send_down(torch.tensor([5], dtype=torch.uint8))
    assert [w.recv_down().tolist() for w in workers] == [[5], [5]]

    master.abort(drain=False)
    for w in workers:
        with pytest.raises(ChannelBroken, match="aborted the exchange"):
            w.recv_down()

    master.abort(drain=True)  # the workers send their next message up, then meet the abort
    for w in workers:
        w.send_up(message(w.rank))
        assert w.recv_relayed() == []
        with pytest.raises(ChannelBroken, match="aborted the exchange"):
            w.recv_down()


def test_forwarded_heads_that_a_worker_does_not_take_are_a_protocol_error(ray_cluster):
    from dpgs.distributed.mailbox import Mailbox, MailboxChannel

    mailbox = Mailbox.remote()
    master, *workers = [MailboxChannel(rank, 3, mailbox, generation=0, timeout_s=30) for rank in range(3)]
    for w in workers:
        w.send_up(message(w.rank))
    master.gather_up(forward=lambda s: s)
    with pytest.raises(RuntimeError, match="recv_relayed must take them"):
        workers[0].recv_down()
