"""The DPGS master role (installed as ``dpgs.master``)."""

from dpgs.master.master import Master

__all__ = ["Master"]
