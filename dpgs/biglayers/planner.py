"""Strip planner: split a big [N, C, H, W] layer into strips that fit one element budget.

A *strip* is a block of whole samples ``[n0, n1)`` and a band of output rows ``[r0, r1)``. Every output
element belongs to exactly one strip, so a sum over strips (weight gradients, BatchNorm statistics) counts
each output once. The input rows a strip reads follow from the sliding window along the height axis:

    output row r reads input rows  r*stride - padding + j*dilation,   j = 0 .. kernel-1

so the band ``[r0, r1)`` reads ``[r0*s - p, (r1-1)*s - p + d*(k-1) + 1)``. The part of that range outside
``[0, H)`` is the zero (or -inf) padding of the image edge; neighbouring bands overlap by the *halo*
``d*(k-1) + 1 - s`` rows when that is positive.

The budget ``max_elements`` bounds the largest tensor the device holds for one strip: the padded input
band and the output band (their gradients have the same shapes). Samples are grouped along the batch
axis when a whole sample fits, otherwise each sample is cut into the fewest row bands that fit, and the
rows are spread evenly over the bands.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowWindow:
    """The sliding window of a layer along the height axis."""

    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    def __post_init__(self) -> None:
        for name in ("kernel", "stride", "dilation"):
            if getattr(self, name) < 1:
                raise ValueError(f"RowWindow.{name} must be >= 1, got {getattr(self, name)}")
        if self.padding < 0:
            raise ValueError(f"RowWindow.padding must be >= 0, got {self.padding}")

    @property
    def extent(self) -> int:
        """Input rows spanned by one window: d*(k-1) + 1."""
        return self.dilation * (self.kernel - 1) + 1

    def out_rows(self, in_rows: int) -> int:
        """Output height of a layer with this window on ``in_rows`` input rows (floor mode)."""
        return (in_rows + 2 * self.padding - self.extent) // self.stride + 1

    def in_rows(self, out_rows: int) -> int:
        """Padded input rows needed to produce ``out_rows`` consecutive output rows."""
        return (out_rows - 1) * self.stride + self.extent

    def input_span(self, r0: int, r1: int) -> tuple[int, int]:
        """Unclipped input rows ``[lo, hi)`` read by output rows ``[r0, r1)``."""
        lo = r0 * self.stride - self.padding
        return lo, lo + self.in_rows(r1 - r0)


@dataclass(frozen=True)
class Strip:
    """One unit of work: samples ``[n0, n1)``, output rows ``[r0, r1)`` and the input rows they read.

    ``lo``/``hi`` are the input rows clipped to the image; ``pad_top``/``pad_bottom`` count the rows of
    edge padding above and below them. ``full_height`` strips hold whole samples (every input and output
    row), so the layer's own padding is used instead of explicit rows; other strips are row bands of one
    sample with explicit edge rows.
    """

    n0: int
    n1: int
    r0: int
    r1: int
    lo: int
    hi: int
    pad_top: int
    pad_bottom: int
    full_height: bool

    @property
    def samples(self) -> int:
        return self.n1 - self.n0

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


def _even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(total)`` into ``parts`` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def plan_strips(
    batch: int,
    height: int,
    window: RowWindow,
    in_row_elements: int,
    out_row_elements: int,
    max_elements: int,
    what: str = "layer",
) -> list[Strip]:
    """Plan the strips of a layer.

    Args:
        batch: samples N of the input.
        height: input rows H.
        window: the layer's sliding window along the height axis.
        in_row_elements: elements of one input row of one sample (C * W).
        out_row_elements: elements of one output row of one sample (C_out * W_out).
        max_elements: budget for the largest device tensor of one strip.
        what: layer description used in error messages.

    Returns:
        Strips in batch-major, row-minor order; each output (sample, row) is owned by exactly one strip.
    """
    if max_elements < 1:
        raise ValueError(f"{what}: max_elements must be a positive integer, got {max_elements}")
    if batch < 1:
        raise ValueError(f"{what}: the input batch is empty")
    out_h = window.out_rows(height)
    if out_h < 1:
        raise ValueError(
            f"{what}: input height {height} is too small for kernel {window.kernel}, "
            f"dilation {window.dilation}, padding {window.padding}"
        )

    def strip_elements(samples: int, rows: int) -> int:
        return samples * max(window.in_rows(rows) * in_row_elements, rows * out_row_elements)

    def make(n0: int, n1: int, r0: int, r1: int, full_height: bool) -> Strip:
        lo, hi = window.input_span(r0, r1)
        clo, chi = max(lo, 0), min(hi, height)
        return Strip(n0, n1, r0, r1, clo, chi, clo - lo, hi - chi, full_height)

    # a full-height strip holds the whole unpadded input (rows a strided window never reads included)
    per_sample = max(height * in_row_elements, out_h * out_row_elements)
    if per_sample <= max_elements:
        group = min(batch, max_elements // per_sample)
        chunks = _even_split(batch, -(-batch // group))
        return [make(n0, n1, 0, out_h, True) for n0, n1 in chunks]

    one_row = strip_elements(1, 1)
    if one_row > max_elements:
        raise ValueError(
            f"{what}: max_elements={max_elements} is smaller than a single output row needs "
            f"({one_row} elements); raise max_elements"
        )
    lo_r, hi_r = 1, out_h  # largest rows with strip_elements(1, rows) <= max_elements
    while lo_r < hi_r:
        mid = (lo_r + hi_r + 1) // 2
        if strip_elements(1, mid) <= max_elements:
            lo_r = mid
        else:
            hi_r = mid - 1
    bands = _even_split(out_h, -(-out_h // lo_r))
    return [make(n, n + 1, r0, r1, False) for n in range(batch) for r0, r1 in bands]
