"""One sparsification step shared by the gradient compressor and the delta broadcaster.

Given a float32 accumulator ``acc`` (gradient plus residual, or parameter delta), pick the positions to send
(the top-k magnitudes of the compressible part plus every element of the dense ranges), optionally scale
the picked values so their L2 norm is at most ``clip_norm``, round them to the value dtype, and leave in
``acc`` exactly what was not sent: afterwards ``sent + acc_after == acc_before`` bit for bit at every
position (see ``dpgs.compression.dtypes``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.compression.dtypes import ValueDtype, quantize
from dpgs.compression.selection import select_topk


@dataclass
class Sent:
    """What one step sends: sorted sparse ``indices``; ``positions`` = indices then the dense ranges'
    positions (None when every element is sent, in order); float32 ``values`` aligned with positions."""

    indices: torch.Tensor
    positions: torch.Tensor | None
    values: torch.Tensor
    method: str
    candidates: int
    clip_scale: float
    selection_ms: float


_TINY = torch.finfo(torch.float32).tiny


def keep_count(keep_ratio: float, n: int) -> int:
    """k for a keep ratio: ``round(keep_ratio * n)``, at least 1 when ``keep_ratio > 0`` and ``n > 0``."""
    if keep_ratio <= 0 or n == 0:
        return 0
    return min(n, max(1, round(keep_ratio * n)))


def check_finite(x: torch.Tensor, buffer: torch.Tensor, what: str) -> None:
    """Raise ValueError when ``x`` holds NaN or infinity (``buffer`` receives ``|x|``)."""
    if x.numel() and not bool(torch.isfinite(torch.abs(x, out=buffer).amax())):
        raise ValueError(f"{what} contains non-finite values (NaN or infinity)")


def dense_positions(ranges: np.ndarray, device: torch.device) -> torch.Tensor:
    parts = [np.arange(o, o + n, dtype=np.int64) for o, n in ranges]
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(device)


def sparsify_(acc: torch.Tensor, k: int, *, ranges: np.ndarray, dense_pos: torch.Tensor, dtype: ValueDtype,
              clip_norm: float | None, magnitude: torch.Tensor, exact_max_numel: int, sample_ratio: float,
              generator: torch.Generator, tensor_ranges: np.ndarray | None = None) -> Sent:
    """Select, clip, round and subtract in place (module docstring). ``magnitude`` is a scratch buffer like
    ``acc``; ``dense_pos`` = ``dense_positions(ranges)``; ``k`` counts compressible elements only.

    ``tensor_ranges`` (one (offset, length) row per compressible tensor): rank each entry by
    ``|acc_i| / rms(acc over its tensor)`` instead of ``|acc_i|``, so that every tensor takes about its
    share of the k entries whatever the scale of its gradient (layer-wise keep ratios)."""
    n = acc.numel()
    check_finite(acc, magnitude, "accumulated vector (input + residual)")
    if tensor_ranges is not None:  # no host sync: an all-zero tensor stays zero after its division
        for offset, length in tensor_ranges:
            part = magnitude[offset : offset + length]
            rms = torch.linalg.vector_norm(part).div_(math.sqrt(length)).clamp_min_(_TINY)
            part.div_(rms)
    for offset, length in ranges:
        magnitude[offset : offset + length] = -1.0  # never selected by top-k: sent dense below
    start = time.perf_counter()
    selection = select_topk(magnitude, k, exact_max_numel=exact_max_numel, sample_ratio=sample_ratio,
                            generator=generator)
    selection_ms = (time.perf_counter() - start) * 1e3
    indices = selection.indices
    every = indices.numel() == n
    positions = None if every else torch.cat([indices, dense_pos])
    original = acc.clone() if every else acc[positions]
    scale = 1.0
    if clip_norm is not None and original.numel():
        norm = float(torch.linalg.vector_norm(original, dtype=torch.float64))
        if norm > clip_norm:
            scale = clip_norm / norm
    if dtype.name == "fp32" and scale == 1.0:
        sent = original  # float32 values unscaled: rounding would change nothing
    else:
        sent = quantize(original * scale if scale < 1.0 else original, original, dtype)
    if every:
        acc.sub_(sent)
    else:
        acc[positions] = original - sent
    return Sent(indices, positions, sent, selection.method, selection.candidates, scale, selection_ms)
