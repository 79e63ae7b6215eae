"""Ray master actor (thin wrapper; the logic lives in ``dpgs.distributed.master_state``)."""

from dpgs.master.actor import Master

__all__ = ["Master"]
