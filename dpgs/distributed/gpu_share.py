"""A worker's share of a GPU that P workers share (DPGS virtual nodes on one GPU).

Ray's fractional GPUs (``num_gpus = 1/P``, ``dpgs.gpus_per_worker``) only schedule: every process on the
GPU can still allocate all of its memory, so one worker's caching allocator can take what the others
need. :func:`cap_to_share` caps this process's CUDA caching allocator at its share of the device's
memory (``torch.cuda.set_per_process_memory_fraction(share)``): a worker that needs more than its share
fails with CUDA's out-of-memory error, which :meth:`GpuShare.exceeded` turns into an error that names the
share and the keys that change it, instead of taking the other workers' memory. The cap bounds what the
allocator hands out; each process's CUDA context (a few hundred MiB) comes on top of it.

:func:`reset_peak` / :func:`peak_bytes` measure the largest memory a step allocated on the device
(``torch.cuda.max_memory_allocated``), reported per worker and step as ``WorkerStep.peak_device_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuShare:
    """This process's share of its CUDA device: ``fraction`` of ``total_bytes``."""

    worker: int
    fraction: float
    total_bytes: int

    @property
    def cap_bytes(self) -> int:
        return int(self.fraction * self.total_bytes)

    def describe(self) -> str:
        total, cap = self.total_bytes / GIB, self.cap_bytes / GIB
        return f"cuda memory cap {self.fraction:g} x {total:.1f} GiB = {cap:.2f} GiB"

    def exceeded(self, err: torch.OutOfMemoryError) -> RuntimeError:
        """The error a worker raises when a step needs more than its share."""
        return RuntimeError(
            f"worker {self.worker} ran out of its share of the GPU ({self.describe()}; "
            f"dpgs.gpus_per_worker={self.fraction:g}): give each worker a larger share (fewer workers per "
            "GPU, dpgs.gpus_per_worker), or use less memory per step (model.big_stages, data.tiles_per_bag, "
            f"train.batch_size). CUDA said: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        )


def cap_to_share(worker: int, device: torch.device) -> GpuShare | None:
    """In a Ray actor that holds a fraction of a GPU (0 < share < 1), caps this process's CUDA allocator
    at that share of ``device``'s memory; None otherwise (CPU, or a whole GPU: nothing to share)."""
    if device.type != "cuda":
        return None
    share = float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0))
    if not 0 < share < 1:
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(share, index)
    return GpuShare(worker, share, torch.cuda.get_device_properties(index).total_memory)


def reset_peak(device: torch.device) -> None:
    """Starts a new peak of allocated device memory (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """The largest device memory allocated since :func:`reset_peak` (0 on CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
