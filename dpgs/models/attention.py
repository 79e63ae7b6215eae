"""Self-attention layers for the transformer heads: Nystrom attention (TransMIL) and multi-head
attention with key masks and an optional EPEG convolution on the attention logits (RRT-MIL)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dpgs.models.layers import Dropout


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of every [m, m] matrix in ``a`` by the iteration of
    Razavi et al. 2014 used by Nystromformer: ``Z0 = A^T / (||A||_1 ||A||_inf)``,
    ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4``. Scaled per matrix (bags stay independent)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm1 = a.abs().sum(-2).amax(-1, keepdim=True).unsqueeze(-1)
    norm_inf = a.abs().sum(-1).amax(-1, keepdim=True).unsqueeze(-1)
    z = a.transpose(-1, -2) / (norm1 * norm_inf)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


class NystromAttention(nn.Module):
    """Nystrom self-attention (Xiong et al., AAAI 2021) as used by TransMIL.

    With n tokens and m landmarks: groups of l = ceil(n / m) consecutive tokens (the first group
    shortened so that the groups tile the sequence; at most m groups) give landmark queries/keys
    ``q~, k~`` as group means, and
    ``softmax(q k~^T) pinv(softmax(q~ k~^T)) softmax(q~ k^T) v`` approximates ``softmax(q k^T) v``
    (exact softmax attention when n <= m). A depthwise convolution over the sequence of the values
    (kernel ``residual_kernel``) is added, as in the reference implementation.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 8,
        landmarks: int = 256,
        pinv_iterations: int = 6,
        residual_kernel: int = 33,
        dropout: float = 0.1,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"NystromAttention: dim {dim} is not divisible by heads {heads}")
        self.heads, self.landmarks, self.pinv_iterations = heads, int(landmarks), int(pinv_iterations)
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Sequential(nn.Linear(dim, dim), Dropout(dropout))
        self.res_conv = nn.Conv2d(
            heads, heads, (residual_kernel, 1), padding=(residual_kernel // 2, 0), groups=heads, bias=False
        )

    def _qkv(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q * self.head_dim**-0.5, k, v

    def _landmarks(self, t: torch.Tensor) -> torch.Tensor:
        """Group means [B, h, g, d] of t [B, h, n, d] (front-padded with zeros, divided by real counts)."""
        n = t.shape[-2]
        size = math.ceil(n / self.landmarks)
        groups = math.ceil(n / size)
        pad = groups * size - n
        counts = torch.full((groups, 1), float(size), dtype=t.dtype, device=t.device)
        counts[0] -= pad
        return F.pad(t, (0, 0, pad, 0)).unflatten(-2, (groups, size)).sum(-2) / counts

    def _attend(self, q_rows, q, k, v=None) -> torch.Tensor:
        """(Approximate) ``softmax(q_rows k^T) v`` (the attention weights when v is None); the
        landmarks come from all queries ``q``."""
        if q.shape[-2] <= self.landmarks:
            a = torch.softmax(q_rows @ k.transpose(-1, -2), -1)
            return a if v is None else a @ v
        q_l, k_l = self._landmarks(q), self._landmarks(k)
        a1 = torch.softmax(q_rows @ k_l.transpose(-1, -2), -1)
        a2 = iterative_pinv(torch.softmax(q_l @ k_l.transpose(-1, -2), -1), self.pinv_iterations)
        a3 = torch.softmax(q_l @ k.transpose(-1, -2), -1)
        return (a1 @ a2) @ a3 if v is None else (a1 @ a2) @ (a3 @ v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        out = self._attend(q, q, k, v) + self.res_conv(v)
        return self.out(out.transpose(1, 2).flatten(2))

    def attention_row(self, x: torch.Tensor, row: int = 0) -> torch.Tensor:
        """[B, n] (approximate) attention of token ``row`` to every token, averaged over heads."""
        q, k, _ = self._qkv(x)
        return self._attend(q[..., row : row + 1, :], q, k).squeeze(-2).mean(1)


class MultiHeadAttention(nn.Module):
    """Softmax multi-head self-attention over x [G, n, dim] with an optional key mask [G, n].

    With ``epeg_k > 0`` a depthwise convolution of kernel (epeg_k, 1) over the query axis of the
    attention logits is added to them before the softmax (EPEG of RRT-MIL, Tang et al. 2023)."""

    def __init__(self, dim: int, heads: int = 8, dropout: float = 0.1, epeg_k: int = 0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"MultiHeadAttention: dim {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_drop = Dropout(dropout)
        self.out = nn.Sequential(nn.Linear(dim, dim), Dropout(dropout))
        self.pe = (
            nn.Conv2d(heads, heads, (epeg_k, 1), padding=(epeg_k // 2, 0), groups=heads)
            if epeg_k > 0
            else None
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        g, n, _ = x.shape
        q, k, v = self.qkv(x).view(g, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        logits = (q * self.head_dim**-0.5) @ k.transpose(-1, -2)  # [G, h, n, n]
        if self.pe is not None:
            logits = logits + self.pe(logits)
        if key_mask is not None:
            logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        attn = self.attn_drop(torch.softmax(logits, -1))
        return self.out((attn @ v).transpose(1, 2).flatten(2))
