"""Device-side memory accounting for big layers.

Every big layer reports the device tensors it holds while it computes one strip (the staged input band,
the padded band, the result band and, in backward, the output-gradient band). The meter keeps

* ``peak_tensor_elements``: the largest single tensor, which the strip planner bounds by ``max_elements``;
* ``peak_strip_elements``: the largest total over the tensors of one strip.

On CUDA the prefetched next input band is resident at the same time, so device memory used by big
layers is at most ``peak_strip_elements`` plus one more input band; ``torch.cuda.max_memory_allocated``
is the allocator's own view of the same thing.
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
