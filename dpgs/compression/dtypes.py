"""Value dtypes of the wire format and the exact rounding of float32 values into them.

A sent value ``t`` is derived from the accumulated float32 value ``g`` it stands for (possibly scaled by a
clipping factor ``c <= 1``) in three steps:

1. ``s = round_to_dtype(clamp(c * g, -max, max))`` (round to nearest; the clamp keeps fp16/bf16 finite);
2. ``t = trunc(s / u) * u`` with ``u = ulp32(g)``, the spacing of float32 numbers around ``g``.

Step 2 makes ``t`` an integer multiple of ``ulp32(g)`` with ``|t| <= |s|``: dropping low-order bits keeps
``t`` representable in the value dtype, and for plain rounding (``c = 1``, no clamp) it changes nothing,
because a rounded value is already a multiple of the (coarser) dtype spacing. Because both ``g`` and ``t``
are multiples of ``u`` and ``|g - t| <= |g|``, the float32 subtraction ``r = g - t`` is exact, hence
``t + r == g`` holds bit for bit. This is what makes the error-feedback invariant exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ValueDtype:
    """One value dtype: its wire code, torch dtype, byte size, unsigned bit-view dtype and largest finite."""

    name: str
    code: int
    torch_dtype: torch.dtype
    itemsize: int
    bits_dtype: str  # numpy little-endian unsigned dtype holding the raw bits
    max_finite: float


VALUE_DTYPES: dict[str, ValueDtype] = {
    "fp32": ValueDtype("fp32", 0, torch.float32, 4, "<u4", float(torch.finfo(torch.float32).max)),
    "fp16": ValueDtype("fp16", 1, torch.float16, 2, "<u2", float(torch.finfo(torch.float16).max)),
    "bf16": ValueDtype("bf16", 2, torch.bfloat16, 2, "<u2", float(torch.finfo(torch.bfloat16).max)),
}
BY_CODE: dict[int, ValueDtype] = {d.code: d for d in VALUE_DTYPES.values()}

_INT_VIEW = {2: torch.int16, 4: torch.int32}


def get_value_dtype(name: str) -> ValueDtype:
    """The ``ValueDtype`` called ``name`` (``fp32``, ``fp16`` or ``bf16``); ValueError otherwise."""
    try:
        return VALUE_DTYPES[name]
    except KeyError:
        raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {name!r}") from None


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float32 numbers at each element of ``x`` (``2**(e-23)`` for a normal number of exponent
    ``e``; ``2**-149`` for zero and subnormals), computed exactly from the exponent bits."""
    biased = (x.contiguous().view(torch.int32) >> 23) & 0xFF  # biased exponent field E
    normal_ulp = (biased - 23).clamp_min(1) << 23  # 2**(E-150) as float32 bits when E > 23
    subnormal_ulp = torch.ones_like(biased) << (biased - 1).clamp(0, 22)  # 2**(E-150) as a subnormal
    return torch.where(biased > 23, normal_ulp, subnormal_ulp).view(torch.float32)


def quantize(scaled: torch.Tensor, original: torch.Tensor, dtype: ValueDtype) -> torch.Tensor:
    """Float32 values ``t`` to send for accumulated values ``original`` (``scaled`` = ``original`` times a
    clipping factor in (0, 1], or ``original`` itself). ``t`` is exactly representable in ``dtype`` and
    ``original - t`` is exact in float32 (module docstring)."""
    if dtype.name == "fp32":
        rounded = scaled
    else:
        rounded = scaled.clamp(-dtype.max_finite, dtype.max_finite).to(dtype.torch_dtype).float()
    unit = ulp32(original)
    return torch.trunc(rounded / unit) * unit


def to_bits(values: torch.Tensor, dtype: ValueDtype) -> np.ndarray:
    """Raw little-endian bits of float32 ``values`` (already representable in ``dtype``) as numpy uints."""
    cast = values.detach().to("cpu", dtype.torch_dtype).contiguous()
    return cast.view(_INT_VIEW[dtype.itemsize]).numpy().view(dtype.bits_dtype)


def from_bits(bits: np.ndarray, dtype: ValueDtype) -> torch.Tensor:
    """Float32 tensor from raw little-endian bits of ``dtype`` (inverse of ``to_bits``)."""
    signed = np.ascontiguousarray(bits).view(f"<i{dtype.itemsize}")
    return torch.from_numpy(signed.copy()).view(dtype.torch_dtype).float()
