"""Staging of strips between host RAM and the compute device.

A ``Channel`` offers two operations used by every big layer:

* ``load(jobs)``: iterate over device copies of host views, one job (a list of views) per strip;
* ``store(src, dst, accumulate)``: write (or add) a device result into a host view; ``finish()`` waits
  until every stored result has landed in host RAM.

``HostChannel`` is used when the compute device is the CPU: the host *is* the device, loads are the views
themselves and stores are plain copies. ``CudaChannel`` implements the pipeline of the Big-Layers paper
with the prefetching of the unified-memory pipeline paper:

* pinned host buffers are allocated once per slot (grown only if a larger strip appears) and reused;
* uploads: the host view is packed into pinned slot ``j % 2`` and copied with ``non_blocking=True`` on an
  upload stream; the next strip is packed and its copy issued *before* the current strip is handed to the
  caller, so the copy of strip j+1 runs while strip j is computed. The compute stream waits on an event
  recorded after each copy, and ``record_stream`` keeps the caching allocator from reusing device memory
  too early. Before a slot is overwritten the host waits on the event of its previous copy;
* downloads: a result is copied into pinned slot ``k % 2`` on a download stream once an event on the
  compute stream says it is ready; the host unpacks slot k into its destination only when the slot is
  needed again (store k+2) or at ``finish()``, so unpacking overlaps with device work. Unpacking follows
  submission order, so overlapping halo gradients are added in a fixed order.

``CudaChannel(overlap=False)`` performs the same staging synchronously; it is the reference the
double-buffered path is tested against on a GPU machine (bit-identical results).

A channel holds per-strip state (pinned slots, pending downloads), so ``channel_for`` keeps one CUDA
channel per device, mode and thread: big layers running in two threads at once never share pinned slots.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence

import torch

_HOST: Channel | None = None
_LOCAL = threading.local()  # .channels: {(device, overlap): CudaChannel} of the current thread


def _is_channels_last(t: torch.Tensor) -> bool:
    """True when ``t`` (possibly a row band of a bigger tensor) is laid out channels-last."""
    return t.dim() == 4 and t.size(1) > 1 and t.stride(1) == 1


def _write(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        dst.add_(src)
    elif not (dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride() and dst.dtype == src.dtype):
        dst.copy_(src)


class Channel:
    """Interface of a host <-> device staging channel (see module docstring).

    ``bytes_to_device`` / ``bytes_to_host`` count the bytes copied across the host-device link.
    """

    host_is_device = False
    bytes_to_device = 0
    bytes_to_host = 0

    def load(self, jobs: Iterable[Sequence[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
        raise NotImplementedError

    def store(self, src: torch.Tensor, dst: torch.Tensor, accumulate: bool = False) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class HostChannel(Channel):
    """The compute device is the host: no copies on load, plain writes on store."""

    host_is_device = True

    def load(self, jobs: Iterable[Sequence[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
        for job in jobs:
            yield list(job)

    def store(self, src: torch.Tensor, dst: torch.Tensor, accumulate: bool = False) -> None:
        _write(dst, src, accumulate)

    def finish(self) -> None:
        return None


class _PinnedSlot:
    """A reusable page-locked byte buffer plus the event of the last copy that used it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def view_like(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned tensor with the shape and memory layout of ``t`` (dense), backed by this slot."""
        nbytes = t.numel() * t.element_size()
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.wait()
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = self.buffer[:nbytes].view(t.dtype)
        if _is_channels_last(t):
            n, c, h, w = t.shape
            return flat.view(n, h, w, c).permute(0, 3, 1, 2)
        return flat.view(t.shape)


class CudaChannel(Channel):
    """Pinned, double-buffered host <-> CUDA staging (see module docstring)."""

    def __init__(self, device: torch.device, overlap: bool = True) -> None:
        self.device = device
        self.overlap = overlap
        if overlap:
            self.up_stream = torch.cuda.Stream(device)
            self.down_stream = torch.cuda.Stream(device)
        self._up: dict[tuple[int, int], _PinnedSlot] = {}
        self._down = [_PinnedSlot(), _PinnedSlot()]
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, bool] | None] = [None, None]
        self._stores = 0

    # uploads -------------------------------------------------------------------------------------
    def _issue(self, j: int, job: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        out = []
        slots = []
        self.bytes_to_device += sum(t.numel() * t.element_size() for t in job)
        for k, host in enumerate(job):
            slot = self._up.setdefault((j % 2, k), _PinnedSlot())
            slot.wait()
            pinned = slot.view_like(host)
            pinned.copy_(host)
            with torch.cuda.stream(self.up_stream):
                out.append(pinned.to(self.device, non_blocking=True))
            slots.append(slot)
        event = torch.cuda.Event()
        event.record(self.up_stream)
        for slot in slots:
            slot.event = event
        return out, event

    def load(self, jobs: Iterable[Sequence[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
        if not self.overlap:
            for job in jobs:
                self.bytes_to_device += sum(t.numel() * t.element_size() for t in job)
                yield [t.to(self.device) for t in job]
            return
        compute = torch.cuda.current_stream(self.device)
        in_flight: list[tuple[list[torch.Tensor], torch.cuda.Event]] = []
        for j, job in enumerate(jobs):
            in_flight.append(self._issue(j, job))
            if len(in_flight) == 2:
                yield self._ready(in_flight.pop(0), compute)
        while in_flight:
            yield self._ready(in_flight.pop(0), compute)

    @staticmethod
    def _ready(issued: tuple[list[torch.Tensor], torch.cuda.Event], compute: torch.cuda.Stream):
        tensors, event = issued
        compute.wait_event(event)
        for t in tensors:
            t.record_stream(compute)
        return tensors

    # downloads -----------------------------------------------------------------------------------
    def _complete(self, index: int) -> None:
        pending = self._pending[index]
        if pending is None:
            return
        _, pinned, dst, accumulate = pending
        self._down[index].wait()
        _write(dst, pinned, accumulate)
        self._pending[index] = None

    def store(self, src: torch.Tensor, dst: torch.Tensor, accumulate: bool = False) -> None:
        self.bytes_to_host += src.numel() * src.element_size()
        if not self.overlap:
            _write(dst, src.to("cpu"), accumulate)
            return
        index = self._stores % 2
        self._complete(index)
        slot = self._down[index]
        pinned = slot.view_like(src)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.down_stream.wait_event(ready)
        with torch.cuda.stream(self.down_stream):
            pinned.copy_(src, non_blocking=True)
        src.record_stream(self.down_stream)
        done = torch.cuda.Event()
        done.record(self.down_stream)
        slot.event = done
        self._pending[index] = (self._stores, pinned, dst, accumulate)
        self._stores += 1

    def finish(self) -> None:
        if not self.overlap:
            return
        order = sorted((p[0], i) for i, p in enumerate(self._pending) if p is not None)
        for _, index in order:
            self._complete(index)


def channel_for(device: torch.device, overlap: bool = True) -> Channel:
    """The channel that stages strips for ``device``: one stateless ``HostChannel`` for the CPU, and one
    cached ``CudaChannel`` per CUDA device, ``overlap`` mode and calling thread."""
    global _HOST
    device = torch.device(device)
    if device.type == "cpu":
        if _HOST is None:
            _HOST = HostChannel()
        return _HOST
    if device.type != "cuda":
        raise ValueError(f"big layers support cpu and cuda devices, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cache = getattr(_LOCAL, "channels", None)
    if cache is None:
        cache = _LOCAL.channels = {}
    key = (str(device), overlap)
    if key not in cache:
        cache[key] = CudaChannel(device, overlap)
    return cache[key]
