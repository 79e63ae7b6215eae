"""What the DPGS master does, independent of Ray (``master.Master`` wraps it in an actor).

The master owns the parameters, the optimizer, the LR schedule and the step counter. A step receives
the workers' gradient payloads, each the gradient of the **sum** of the losses of that worker's bags,
and forms the mini-batch gradient

    g = (1 / B) * sum_workers decode(payload_w),    B = number of bags in the step,

which equals the gradient of the mean per-bag loss over the B bags, whatever their lengths and however
they were spread over workers. It then clips (optional), steps the optimizer and encodes the weight
delta for the workers (error feedback on the broadcast: workers hold master params minus the
broadcaster's residual).
"""

from __future__ import annotations

import time

import torch

from dpgs.config.schema import CompressionConfig, TrainConfig
from dpgs.distributed.codec import DeltaEncoder, decode_gradient
from dpgs.distributed.flat import flat_buffers, flat_params, load_flat_buffers, set_flat_grads, trainable
from dpgs.train.optim import build_optimizer, build_scheduler


class MasterState:
    def __init__(self, model_spec, train: TrainConfig, compression: CompressionConfig):
        self.model = model_spec.build()
        self.train_cfg = train
        self.optimizer = build_optimizer(trainable(self.model), train)
        self.scheduler = build_scheduler(self.optimizer, train)
        self.compression = compression
        self.delta = DeltaEncoder(compression)
        self.step_count = 0
        self.epoch = 0

    def snapshot(self) -> bytes:
        """Dense weights that in-sync workers hold (for a joining or restarted worker)."""
        return self.delta.snapshot(flat_params(self.model))

    def buffers(self) -> torch.Tensor | None:
        return flat_buffers(self.model)

    def merge_buffers(self, buffers: list[torch.Tensor | None], counts: list[int]) -> torch.Tensor | None:
        """Running statistics = bag-count-weighted mean of the workers' (exact when one worker ran)."""
        pairs = [(b, c) for b, c in zip(buffers, counts, strict=True) if b is not None and c > 0]
        if not pairs:
            return self.buffers()
        merged = sum(b * c for b, c in pairs) / sum(c for _, c in pairs)
        load_flat_buffers(self.model, merged)
        return merged

    def step(
        self,
        n_bags: int,
        payloads: list[bytes],
        buffers: list | None = None,
        counts: list[int] | None = None,
        keep_ratio: float = 1.0,
    ) -> tuple[bytes, torch.Tensor | None, dict]:
        """Average, step, merge running statistics; return (weight update payload, buffers, stats)."""
        if n_bags < 1:
            raise ValueError("a step needs at least one bag")
        start = time.perf_counter()
        merged = self.merge_buffers(buffers or [], counts or [])
        total = None
        for payload in payloads:
            g = decode_gradient(payload)
            total = g if total is None else total.add_(g)
        decode_seconds = time.perf_counter() - start
        set_flat_grads(self.model, total / n_bags)
        grad_norm = float(torch.linalg.vector_norm(total / n_bags))
        if self.train_cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable(self.model), self.train_cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        update, enc = self.delta.update(flat_params(self.model), keep_ratio)
        return (
            update,
            merged,
            {
                "step": self.step_count,
                "grad_norm": grad_norm,
                "decode_seconds": decode_seconds,
                "master_seconds": time.perf_counter() - start,
                "down_bytes": len(update),
                "down_dense_bytes": enc["dense_bytes"],
            },
        )

    def end_epoch(self) -> float:
        """Advance the LR schedule; returns the new learning rate."""
        self.epoch += 1
        if self.scheduler is not None:
            self.scheduler.step()
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        """Everything needed to resume: model, optimizer, scheduler, counters."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "step": self.step_count,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint; the broadcast restarts with a dense snapshot of the restored weights."""
        self.model.load_state_dict(state["model"])
        self.delta = DeltaEncoder(self.compression)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])
        self.epoch = int(state["epoch"])

    def model_state(self) -> dict:
        return self.model.state_dict()
