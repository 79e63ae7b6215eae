"""Top-k gradient compressor with error feedback (DGC / DMGC, worker -> master direction).

Per call, with residual ``r`` (and, with momentum correction, momentum ``u`` and coefficient ``m``)::

    plain:               acc = r + flat
    momentum correction: u = m * u + flat;  acc = r + u            (DGC, Lin et al. 2017)
    send the top keep_ratio fraction of |acc| (+ the dense-exempt tensors), clipped and rounded;
    r = acc - sent                                                  (exact: nothing is ever lost)
    momentum factor masking: u[sent sparse positions] = 0

so ``decompress(payload) + r_new == acc`` holds bit for bit. The keep ratio is an argument of each call
(a schedule chooses it per step). :meth:`TopKCompressor.flush` sends everything: it returns ``acc`` itself
as float32 and empties the residual (with masking, the momentum too). With momentum correction the workers
already apply momentum, so the master must step with plain SGD (no momentum) on the aggregated payloads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.compression import wire
from dpgs.compression.dtypes import get_value_dtype, to_bits
from dpgs.compression.layout import ParamLayout
from dpgs.compression.sparsify import check_finite, dense_positions, keep_count, sparsify_


@dataclass(frozen=True)
class CompressionStats:
    """Accounting of one ``compress`` call; bytes are ``len(payload)`` and 4 bytes per dense element."""

    numel: int
    k: int
    count: int
    dense_count: int
    payload_bytes: int
    dense_bytes: int
    ratio: float
    method: str
    candidates: int
    clip_scale: float
    selection_ms: float
    encode_ms: float


def _check_ratio(keep_ratio: float) -> float:
    keep_ratio = float(keep_ratio)
    if not 0.0 <= keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in [0, 1], got {keep_ratio}")
    return keep_ratio


class TopKCompressor:
    """Stateful worker-side compressor of flat float32 vectors (see the module docstring).

    clip_norm: scale the sent values down to this L2 norm (the excess stays in the residual).
    value_dtype: "fp16", "bf16" or "fp32" for the sent values (rounding error stays in the residual).
    momentum_correction: DGC momentum coefficient ``m`` (None = plain error feedback).
    momentum_masking: DGC momentum factor masking (zero ``u`` where sparse entries were sent).
    layout / dense_min_numel: tensors flagged dense in ``layout``, or with fewer than ``dense_min_numel``
        elements, are sent uncompressed every call (without a layout the whole vector counts as one tensor).
    exact_max_numel / sample_ratio / seed: selection (``dpgs.compression.selection``).
    ranking: "magnitude" keeps the entries of largest ``|acc_i|`` over the whole vector; "tensor_rms" those
        of largest ``|acc_i| / rms(acc over the tensor of i)`` (needs ``layout``; without one the vector is
        one tensor and both rankings agree), so every tensor of the layout sends about its share of k
        whatever the scale of its gradient (``dpgs.compression.sparsify.sparsify_``).
    """

    def __init__(self, clip_norm: float | None = None, value_dtype: str = "fp16",
                 zstd_level: int = 3, momentum_correction: float | None = None, momentum_masking: bool = True,
                 dense_min_numel: int = 0, layout: ParamLayout | None = None, exact_max_numel: int = 1 << 20,
                 sample_ratio: float = 0.01, seed: int = 0, ranking: str = "magnitude"):
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {clip_norm}")
        if momentum_correction is not None and not 0.0 <= momentum_correction < 1.0:
            raise ValueError(f"momentum_correction must be in [0, 1) or None, got {momentum_correction}")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        self.clip_norm = clip_norm
        self.dtype = get_value_dtype(value_dtype)
        self.zstd_level = int(zstd_level)
        self.momentum_correction = momentum_correction
        self.momentum_masking = momentum_masking
        self.dense_min_numel = int(dense_min_numel)
        self.layout = layout
        self.exact_max_numel = int(exact_max_numel)
        self.sample_ratio = float(sample_ratio)
        self.generator = torch.Generator().manual_seed(seed)
        if ranking not in ("magnitude", "tensor_rms"):
            raise ValueError(f"ranking must be 'magnitude' or 'tensor_rms', got {ranking!r}")
        self.ranking = ranking
        self._tensor_ranges: np.ndarray | None = None
        self.residual: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self.step = 0
        self.last_stats: CompressionStats | None = None
        self._magnitude: torch.Tensor | None = None
        self._ranges = np.zeros((0, 2), dtype=np.int64)
        self._dense_pos: torch.Tensor | None = None

    def _prepare(self, n: int, device: torch.device) -> None:
        if self.residual is not None:
            if self.residual.numel() != n:
                raise ValueError(f"flat vector has {n} elements, this compressor was set up for "
                                 f"{self.residual.numel()} (call reset() to change size)")
            return
        if self.layout is not None:
            if self.layout.numel != n:
                raise ValueError(f"flat vector has {n} elements, the layout has {self.layout.numel}")
            layout = self.layout.with_dense_min_numel(self.dense_min_numel)
            self._ranges = layout.dense_ranges()
            if self.ranking == "tensor_rms":
                self._tensor_ranges = layout.sparse_ranges()
        elif 0 < n < self.dense_min_numel:
            self._ranges = np.array([[0, n]], dtype=np.int64)
        self.residual = torch.zeros(n, dtype=torch.float32, device=device)
        self._magnitude = torch.empty_like(self.residual)
        self._dense_pos = dense_positions(self._ranges, device)
        if self.momentum_correction is not None:
            self.momentum = torch.zeros_like(self.residual)

    def reset(self) -> None:
        """Forget the residual, the momentum and the size (the next call starts afresh)."""
        self.residual = self.momentum = self._magnitude = self._dense_pos = self._tensor_ranges = None
        self._ranges = np.zeros((0, 2), dtype=np.int64)

    def _accumulate(self, flat: torch.Tensor) -> torch.Tensor:
        """``acc`` (in ``self.residual``) of the module docstring; returns ``flat`` as flat float32."""
        if not torch.is_floating_point(flat):
            raise ValueError(f"flat must be a floating-point tensor, got {flat.dtype}")
        flat = flat.detach().reshape(-1).to(torch.float32)
        self._prepare(flat.numel(), flat.device)
        check_finite(flat, self._magnitude, "input vector")
        if self.momentum is not None:
            self.momentum.mul_(self.momentum_correction).add_(flat)
            self.residual.add_(self.momentum)
        else:
            self.residual.add_(flat)
        return flat

    def flush(self, flat: torch.Tensor) -> torch.Tensor:
        """Send everything: ``acc`` as a float32 vector; the residual (and, with masking, the momentum) is
        emptied. Without anything kept (no residual yet, no momentum) that is ``flat`` itself. Without
        momentum correction nothing is kept after a flush either (the residual vector itself is sent, and
        a later :meth:`compress` starts from a zero residual, as after :meth:`reset`): dense steps after
        compressed ones copy nothing, and the checkpointed state stays small."""
        if self.residual is None and self.momentum_correction is None:
            return flat.detach().reshape(-1).to(torch.float32)
        self._accumulate(flat)
        if self.momentum_correction is None:
            sent, self.residual = self.residual, None
            self.step += 1
            return sent
        sent = self.residual.clone()
        self.residual.zero_()
        if self.momentum is not None and self.momentum_masking:
            self.momentum.zero_()
        self.step += 1
        return sent

    def compress(self, flat: torch.Tensor, keep_ratio: float, version: int | None = None) -> bytes:
        """Payload of the top ``keep_ratio`` fraction (in [0, 1]) of ``residual + flat`` (``flat``: any shape,
        floating point); ``version`` goes into the header (default: the number of previous calls). Updates
        the residual and ``last_stats``."""
        start = time.perf_counter()
        keep_ratio = _check_ratio(keep_ratio)
        flat = self._accumulate(flat)
        n = flat.numel()
        k = keep_count(keep_ratio, n - int(self._ranges[:, 1].sum()))
        sent = sparsify_(self.residual, k, ranges=self._ranges, dense_pos=self._dense_pos, dtype=self.dtype,
                         clip_norm=self.clip_norm, magnitude=self._magnitude,
                         exact_max_numel=self.exact_max_numel, sample_ratio=self.sample_ratio,
                         generator=self.generator, tensor_ranges=self._tensor_ranges)
        if self.momentum is not None and self.momentum_masking:
            self.momentum[sent.indices] = 0.0
        version = self.step if version is None else int(version)
        indices = None if sent.positions is None else sent.indices.cpu().numpy()
        payload = wire.encode(kind=wire.KIND_GRADIENT, numel=n, indices=indices,
                              value_bits=to_bits(sent.values, self.dtype), dtype=self.dtype,
                              ranges=None if sent.positions is None else self._ranges, version=version,
                              zstd_level=self.zstd_level)
        self.step += 1
        dense_bytes = 4 * n
        self.last_stats = CompressionStats(
            numel=n, k=k, count=sent.indices.numel(), dense_count=int(self._ranges[:, 1].sum()),
            payload_bytes=len(payload), dense_bytes=dense_bytes, ratio=dense_bytes / len(payload),
            method=sent.method, candidates=sent.candidates, clip_scale=sent.clip_scale,
            selection_ms=sent.selection_ms, encode_ms=(time.perf_counter() - start) * 1e3)
        return payload

    def state_dict(self) -> dict:
        """Residual, momentum, step and generator state (for checkpointing a worker)."""
        return {"residual": None if self.residual is None else self.residual.clone(),
                "momentum": None if self.momentum is None else self.momentum.clone(),
                "step": self.step, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        self.reset()
        if residual is not None:
            self._prepare(residual.numel(), residual.device)
            self.residual.copy_(residual)
            if self.momentum is not None:
                if state["momentum"] is None:
                    raise ValueError("state has no momentum but this compressor uses momentum correction")
                self.momentum.copy_(state["momentum"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
