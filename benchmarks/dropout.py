"""Dropout on the CPU: a head's training step with ``nn.Dropout`` against dpgs's ``Dropout`` (same model,
same bags, one thread), alternating, medians of repeats.

    python benchmarks/dropout.py [--heads abmil clam_sb] [--repeats 15] [--out FILE]

Two steps per head: a DPGS worker's step (8 bags in one packed forward/backward, the demo's bags: 64
features, 10-120 instances) and a classic step (one bag, then Adam). ``nn.Dropout`` is put back by
swapping the dropout layers of one model (same weights), the order alternating per repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from dpgs.models import build_head
from dpgs.models.layers import Dropout
from dpgs.train.steps import batch_loss


def use_dropout(model: nn.Module, cls: type[nn.Dropout]) -> nn.Module:
    """``model`` with each dropout layer replaced by ``cls`` of the same ``p`` (the weights are kept)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Dropout):
                setattr(module, name, cls(child.p))
    return model


def bags(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(n), 64, generator=g) for n in torch.randint(10, 120, (count,), generator=g)]


def seconds_per_step(model: nn.Module, batch: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                     steps: int) -> float:
    labels = torch.tensor([i % 2 for i in range(len(batch))])
    mode = "packed" if len(batch) > 1 else "classic"

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = batch_loss(model, batch, labels, mode, None)
        (out["per_bag"].sum() if mode == "packed" else out["loss"]).backward()
        if optimizer is not None:
            optimizer.step()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def measure(head: str, repeats: int) -> dict:
    """One model, its dropout layers swapped between the two kinds; the order alternates per repeat."""
    torch.manual_seed(0)
    model = build_head(head, 64, 2).train()
    worker_batch, classic_batch = bags(8, 0), bags(1, 1)
    kinds = {"torch": nn.Dropout, "dpgs": Dropout}
    times: dict[str, list[float]] = {f"{step}_{k}": [] for step in ("worker", "classic") for k in kinds}
    for r in range(repeats):
        for label in (("torch", "dpgs") if r % 2 == 0 else ("dpgs", "torch")):
            use_dropout(model, kinds[label])
            times[f"worker_{label}"].append(seconds_per_step(model, worker_batch, None, 20))
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            times[f"classic_{label}"].append(seconds_per_step(model, classic_batch, opt, 40))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"head": head, **med,
            "worker_ratio": med["worker_dpgs"] / med["worker_torch"],
            "classic_ratio": med["classic_dpgs"] / med["classic_torch"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", default=["abmil", "clam_sb"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    lines = [f"# torch {torch.__version__}, 1 thread, medians of {args.repeats} alternating repeats", "",
             "| head | worker step, nn.Dropout (ms) | worker step, dpgs Dropout (ms) | ratio | "
             "classic step, nn.Dropout (ms) | classic step, dpgs Dropout (ms) | ratio |",
             "|---|---|---|---|---|---|---|"]
    for head in args.heads:
        r = measure(head, args.repeats)
        lines.append(f"| {head} | {r['worker_torch']:.2f} | {r['worker_dpgs']:.2f} | "
                     f"{r['worker_ratio']:.2f} | {r['classic_torch']:.2f} | {r['classic_dpgs']:.2f} | "
                     f"{r['classic_ratio']:.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
