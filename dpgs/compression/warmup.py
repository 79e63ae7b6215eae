"""Keep-ratio warm-up (DGC "sparsity warm-up"): send more in the first epochs, then the target ratio.

DGC raises sparsity exponentially over the first four epochs (75 %, 93.75 %, 98.4375 %, 99.6 %), i.e. keep
ratios 25 %, 6.25 %, 1.5625 %, 0.390625 %, then the target. A warm-up ratio below the target is replaced by
the target (warm-up never sends less than the steady state).
"""

from __future__ import annotations

from collections.abc import Sequence

DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.00390625)


class KeepRatioSchedule:
    """``ratio(epoch) = max(target, warmup[epoch])`` for ``epoch < len(warmup)``, else ``target``."""

    def __init__(self, target: float, warmup: Sequence[float] = DGC_WARMUP):
        self.target = float(target)
        self.warmup = tuple(float(r) for r in warmup)
        named = [("target", self.target)] + [(f"warmup[{i}]", r) for i, r in enumerate(self.warmup)]
        for name, ratio in named:
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"keep ratio {name} must be in (0, 1], got {ratio}")

    @classmethod
    def exponential(cls, target: float, epochs: int = 4, start: float = 0.25, factor: float = 0.25
                    ) -> KeepRatioSchedule:
        """Warm-up ``start * factor**e`` for epochs ``e < epochs`` (DGC: 0.25, 0.25, 4 epochs)."""
        if epochs < 0 or not 0.0 < factor <= 1.0:
            raise ValueError(f"need epochs >= 0 and factor in (0, 1], got {epochs}, {factor}")
        return cls(target, [start * factor**e for e in range(epochs)])

    def ratio(self, epoch: int) -> float:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return max(self.target, self.warmup[epoch]) if epoch < len(self.warmup) else self.target

    def __call__(self, epoch: int) -> float:
        return self.ratio(epoch)

    def __repr__(self) -> str:
        return f"KeepRatioSchedule(target={self.target}, warmup={self.warmup})"
