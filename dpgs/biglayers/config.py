"""Settings shared by the big layers of one model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dpgs.biglayers.memory import MemoryMeter

DEFAULT_MAX_ELEMENTS = 1 << 24
_STORAGE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class BigConfig:
    """How big layers partition and store their activations.

    Attributes:
        max_elements: budget of the largest device tensor of one strip (see ``planner``).
        storage_dtype: dtype of the activations a big layer writes to host RAM; ``None`` keeps the dtype
            of the layer's input. ``torch.float16``/``torch.bfloat16`` halve host RAM and transfer volume.
        channels_last: store host activations in channels-last order, which makes a band of rows of one
            sample a single contiguous block (one DMA per strip on CUDA).
        overlap: on CUDA, stage strips through reused pinned buffers with double-buffered asynchronous
            copies on side streams; ``False`` uses plain synchronous copies (same results).
        meter: device-side memory accounting shared by the layers.
    """

    max_elements: int = DEFAULT_MAX_ELEMENTS
    storage_dtype: torch.dtype | None = None
    channels_last: bool = False
    overlap: bool = True
    meter: MemoryMeter = field(default_factory=MemoryMeter)

    def __post_init__(self) -> None:
        if isinstance(self.max_elements, bool) or not isinstance(self.max_elements, int):
            raise TypeError(f"max_elements must be an int, got {type(self.max_elements).__name__}")
        if self.max_elements < 1:
            raise ValueError(f"max_elements must be >= 1, got {self.max_elements}")
        if self.storage_dtype not in _STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {_STORAGE_DTYPES}, got {self.storage_dtype}")

    def host_dtype(self, input_dtype: torch.dtype) -> torch.dtype:
        """Dtype of the host tensors a layer writes, given the dtype of its input."""
        return self.storage_dtype or input_dtype

    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


def compute_dtype(device: torch.device, param_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the device computation: the autocast dtype for float32 parameters when autocast is on."""
    if param_dtype == torch.float32 and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return param_dtype


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of per-strip reductions: at least float32 (half-precision strips are widened)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
