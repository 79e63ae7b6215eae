"""Device-side memory accounting for big layers.

Every big layer reports the device tensors it holds while it computes one strip (the staged input band,
the padded band, the result band and, in backward, the output-gradient band). The meter keeps

* ``peak_tensor_elements``: the largest single tensor, which the strip planner bounds by ``max_elements``;
* ``peak_strip_elements``: the largest total over the tensors of one strip.

On CUDA with ``overlap=True`` more is resident than the meter sees: the next strip's input bands
(prefetched) and up to two result bands whose copy back to host RAM is still running, each at most
``max_elements`` elements. Device memory used by big layers is therefore bounded by about
``peak_strip_elements + 4 * max_elements`` elements, independent of the input size;
``torch.cuda.max_memory_allocated`` is the allocator's own view of it (flat in the image size, measured
on an H100 in ``docs/benchmarks/biglayers_gpu.md``).
"""

from __future__ import annotations

import torch


class MemoryMeter:
    """Peak element counts of the device tensors held by big layers (see module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget all observations."""
        self.peak_tensor_elements = 0
        self.peak_strip_elements = 0
        self.strips = 0

    def observe(self, *tensors: torch.Tensor | None) -> None:
        """Record the tensors held together for one strip."""
        sizes = [t.numel() for t in tensors if t is not None]
        if not sizes:
            return
        self.strips += 1
        self.peak_tensor_elements = max(self.peak_tensor_elements, max(sizes))
        self.peak_strip_elements = max(self.peak_strip_elements, sum(sizes))

    def as_dict(self) -> dict[str, int]:
        return {
            "peak_tensor_elements": self.peak_tensor_elements,
            "peak_strip_elements": self.peak_strip_elements,
            "strips": self.strips,
        }
