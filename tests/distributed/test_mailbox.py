"""The Ray mailbox transport's messages down (``dpgs.distributed.mailbox``): a message for every worker, one
message per worker, and the master's abort, each received only by the worker it is for."""

from __future__ import annotations

import pytest
import torch

from dpgs.distributed.transport import ChannelBroken


def test_each_worker_receives_its_own_message_the_shared_one_and_the_abort(ray_cluster):
    from dpgs.distributed.mailbox import Mailbox, MailboxChannel

    mailbox = Mailbox.remote()
    master, *workers = [MailboxChannel(rank, 3, mailbox, generation=0, timeout_s=30) for rank in range(3)]
    for w in workers:
        w.send_up(torch.tensor([w.rank], dtype=torch.uint8))
    assert [int(b[0]) for b in master.gather_up()] == [1, 2]

    master.send_each([torch.tensor([10, 11], dtype=torch.uint8), torch.tensor([20], dtype=torch.uint8)])
    assert [w.recv_down().tolist() for w in workers] == [[10, 11], [20]]

    for w in workers:
        w.send_up(torch.tensor([w.rank], dtype=torch.uint8))
    master.gather_up()
    master.send_down(torch.tensor([7, 7, 7], dtype=torch.uint8))
    assert [w.recv_down().tolist() for w in workers] == [[7, 7, 7], [7, 7, 7]]

    master.abort(drain=False)
    for w in workers:
        with pytest.raises(ChannelBroken, match="aborted the exchange"):
            w.recv_down()
    with pytest.raises(ValueError, match="1 messages for 2 workers"):
        master.send_each([torch.tensor([1], dtype=torch.uint8)])
