"""Partition of one image (and of every activation derived from it) over a grid of ranks.

The G ranks of a sample-parallel group form a ``rows x cols`` grid (row-major: rank = i * cols + j).
Every activation of spatial size (H, W) is cut into ``rows`` row bands and ``cols`` column bands whose
sizes differ by at most one (the even split of ``dpgs.biglayers.planner``); rank (i, j) *owns* the
rectangle ``rows_i x cols_j``. Each output element of every layer is therefore owned by exactly one
rank, so sums over ranks (weight gradients, BatchNorm statistics) count every position once.

A windowed layer (convolution, max pooling) with window (kernel k, stride s, padding p, dilation d) along
an axis maps the owned output range [r0, r1) to the input range it reads (``RowWindow.input_span``):

    [r0*s - p,  (r1-1)*s - p + d*(k-1) + 1)

The part of that range outside the image is edge padding (zeros for a convolution, -inf for max
pooling); the rest is owned by the rank itself or by other ranks (the *halo*). ``HaloPlan`` lists, for
every pair of ranks, the rectangle one sends to the other. Because every rank derives the same plan from
the shapes alone, no plan is ever communicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from dpgs.biglayers.planner import RowWindow, _even_split


@dataclass(frozen=True)
class Grid:
    """``rows x cols`` ranks in row-major order."""

    rows: int
    cols: int = 1

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sample grid {name} must be an int >= 1, got {value!r}")

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def coords(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a {self.rows}x{self.cols} grid")
        return divmod(rank, self.cols)


def make_grid(ranks: int, shape: tuple[int, int] | list[int] | None = None) -> Grid:
    """The grid of ``ranks`` ranks: ``shape`` = (rows, cols) (``dpgs.sample_grid``), default (ranks, 1)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"dpgs.sample_parallel must be an int >= 1, got {ranks!r}")
    if shape is None:
        return Grid(ranks, 1)
    if len(shape) != 2:
        raise ValueError(f"dpgs.sample_grid must be [rows, cols], got {shape!r}")
    grid = Grid(int(shape[0]), int(shape[1]))
    if grid.size != ranks:
        raise ValueError(
            f"dpgs.sample_grid {list(shape)} has {grid.size} ranks but dpgs.sample_parallel={ranks}")
    return grid


@dataclass(frozen=True)
class Rect:
    """Rows [r0, r1) x columns [c0, c1) of an activation (global coordinates)."""

    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def empty(self) -> bool:
        return self.r1 <= self.r0 or self.c1 <= self.c0

    @property
    def area(self) -> int:
        return max(self.r1 - self.r0, 0) * max(self.c1 - self.c0, 0)

    def intersect(self, other: Rect) -> Rect:
        return Rect(max(self.r0, other.r0), min(self.r1, other.r1),
                    max(self.c0, other.c0), min(self.c1, other.c1))

    def shift(self, dr: int, dc: int) -> tuple[slice, slice]:
        """Slices of this rectangle inside a tensor whose element [0, 0] is global (dr, dc)."""
        return slice(self.r0 - dr, self.r1 - dr), slice(self.c0 - dc, self.c1 - dc)


@dataclass(frozen=True)
class Partition:
    """Ownership of an (H, W) activation on ``grid`` (see module docstring)."""

    grid: Grid
    height: int
    width: int
    what: str = field(default="activation", compare=False)

    def __post_init__(self) -> None:
        if self.height < self.grid.rows or self.width < self.grid.cols:
            raise ValueError(
                f"{self.what}: a {self.height}x{self.width} activation cannot be split over a "
                f"{self.grid.rows}x{self.grid.cols} grid (every rank needs at least one row and column); "
                f"use a larger input, fewer ranks or fewer partitioned stages")

    @cached_property
    def _bounds(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return _even_split(self.height, self.grid.rows), _even_split(self.width, self.grid.cols)

    def owned(self, rank: int) -> Rect:
        i, j = self.grid.coords(rank)
        rows, cols = self._bounds
        return Rect(*rows[i], *cols[j])

    def shape(self, rank: int) -> tuple[int, int]:
        o = self.owned(rank)
        return o.r1 - o.r0, o.c1 - o.c0


@dataclass(frozen=True)
class Transfer:
    """``rect`` (global input coordinates) travels from rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    rect: Rect


class HaloPlan:
    """What each rank needs, and receives from whom, to apply a windowed layer to its output rectangle.

    ``need(rank)`` is the unclipped input rectangle read by the rank's owned output rectangle; the
    extended input tensor a rank builds has exactly that extent, with edge padding where it leaves the
    image, so the layer itself runs with zero padding.
    """

    def __init__(self, inp: Partition, rows: RowWindow, cols: RowWindow, what: str = "layer") -> None:
        self.inp = inp
        self.rows, self.cols = rows, cols
        out_h, out_w = rows.out_rows(inp.height), cols.out_rows(inp.width)
        if out_h < 1 or out_w < 1:
            raise ValueError(f"{what}: input {inp.height}x{inp.width} is too small for its window")
        self.out = Partition(inp.grid, out_h, out_w, what)
        self.transfers: list[Transfer] = []
        image = Rect(0, inp.height, 0, inp.width)
        for dst in range(inp.grid.size):
            need = self.need(dst).intersect(image)
            for src in range(inp.grid.size):
                piece = need.intersect(inp.owned(src))
                if not piece.empty:
                    self.transfers.append(Transfer(src, dst, piece))

    def need(self, rank: int) -> Rect:
        o = self.out.owned(rank)
        r0, r1 = self.rows.input_span(o.r0, o.r1)
        c0, c1 = self.cols.input_span(o.c0, o.c1)
        return Rect(r0, r1, c0, c1)

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def receives(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]

    def halo_elements(self) -> int:
        """Spatial positions moved between different ranks (multiply by N*C for elements)."""
        return sum(t.rect.area for t in self.transfers if t.src != t.dst)
