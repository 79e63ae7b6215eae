"""The baseline a user would write instead of DPGS: PyTorch DDP with gloo, P processes on this machine.

Same model, bags, step composition and learning-rate schedule as a dpgs run with the same config: each
optimizer step takes the epoch's next B bags (``dpgs.train.batching.epoch_batches``), spread over the P
ranks by length (LPT, as DPGS does), and each rank back-propagates ``(P / B) * loss_b`` for its bags, so
that DDP's gradient average is the mean per-bag loss gradient of the step. ``loop`` mode runs one
backward per bag under ``no_sync()`` with one all-reduce per step (what most MIL code would do);
``packed`` mode runs one packed forward/backward per rank (dpgs's own segment operations). Rank 0
evaluates on the validation bags after each epoch (the other ranks wait), like ``dpgs train``.

    python benchmarks/ddp_baseline.py --workers 2 [--style loop|packed] train.epochs=8 [dotted overrides]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpgs.config import load_config
from dpgs.distributed.assignment import assign_lpt
from dpgs.experiment import load_experiment_data
from dpgs.metrics import classification_metrics
from dpgs.modeling import ModelSpec
from dpgs.train.batching import epoch_batches
from dpgs.train.optim import build_optimizer, learning_rate
from dpgs.train.steps import batch_loss


@torch.no_grad()
def bag_metrics(model: torch.nn.Module, dataset, indices: list[int], prefix: str) -> dict[str, float]:
    """Metrics of the model's predictions on whole bags (eval mode), as ``dpgs train`` computes them."""
    model.eval()
    labels, probs = [], []
    for i in indices:
        bag = dataset.get(i, 0)
        logits = model.loss(bag.features, torch.tensor(bag.label))["logits"].reshape(1, -1)
        labels.append(int(bag.label))
        probs.append(torch.softmax(logits.float(), -1)[0].numpy())
    model.train()
    return {f"{prefix}{k}": v for k, v in classification_metrics(labels, probs).items()}


class BagLoss(torch.nn.Module):
    """DDP wraps this: its forward is the per-bag losses of a list of bags (DDP's reducer is armed by the
    wrapped forward, so the loss must be computed inside it)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, features: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        return batch_loss(self.model, features, labels, "packed")["per_bag"]


def _rank_main(rank: int, world: int, store_file: str, overrides: list[str], style: str, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # the ranks share this machine: a file rendezvous, with no port that another socket could take first
    store = dist.FileStore(store_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    start = time.perf_counter()
    config = load_config(None, overrides)
    data = load_experiment_data(config.data, seed=config.seed)
    split, dataset = data.splits[0], data.dataset
    classes = len(data.manifest.classes)
    torch.manual_seed(config.seed)
    model = ModelSpec(config.model, dataset.feature_dim, classes).build()
    ddp = torch.nn.parallel.DistributedDataParallel(BagLoss(model))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, config.train)
    lengths = dataset.lengths()
    batch_size, train = config.train.batch_size, config.train
    history = []
    setup = time.perf_counter() - start
    for epoch in range(1, train.epochs + 1):
        epoch_start = time.perf_counter()
        model.train()
        batches = epoch_batches(split.train, batch_size, config.seed, epoch)
        loss_sum = 0.0
        for s, batch in enumerate(batches):
            mine = [batch[p] for p in assign_lpt([lengths[i] for i in batch], world)[rank]]
            scale = world / len(batch)
            bags = [dataset.get(i, epoch) for i in mine]
            labels = torch.tensor([b.label for b in bags])
            if style == "packed":
                per_bag = ddp([b.features for b in bags], labels)
                (per_bag.sum() * scale).backward()
                loss_sum += float(per_bag.detach().sum())
            else:
                for b, bag in enumerate(bags):
                    with ddp.no_sync() if b < len(bags) - 1 else contextlib.nullcontext():
                        per_bag = ddp([bag.features], labels[b : b + 1])
                        (per_bag.sum() * scale).backward()
                    loss_sum += float(per_bag.detach().sum())
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(train, epoch, s, len(batches))
            optimizer.step()
            optimizer.zero_grad()
        train_seconds = time.perf_counter() - epoch_start
        row = {"epoch": epoch, "train_seconds": train_seconds}
        if rank == 0 and split.val:
            row.update(bag_metrics(model, dataset, split.val, "val_"))
        dist.barrier()
        row["elapsed_seconds"] = time.perf_counter() - start
        row["train_loss"] = loss_sum / len(split.train)  # this rank's bags only (a rough figure)
        history.append(row)
    if rank == 0:
        test = {}
        if split.test:
            test = bag_metrics(model, dataset, split.test, "test_")
        Path(out).write_text(json.dumps({"history": history, "test": test, "setup_seconds": setup}))
    dist.destroy_process_group()


def run_ddp(overrides: list[str], workers: int = 2, style: str = "loop") -> dict:
    """Train with DDP; returns ``history`` (per epoch: train_seconds, elapsed_seconds, val_*), ``test``,
    and ``wall_seconds`` (processes started to finished, as a user times the command)."""
    if style not in ("loop", "packed"):
        raise ValueError(f"style must be loop or packed, got {style!r}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ddp.json")
        start = time.perf_counter()
        store = str(Path(tmp) / "store")
        mp.spawn(_rank_main, args=(workers, store, list(overrides), style, out), nprocs=workers)
        result = json.loads(Path(out).read_text())
    result["wall_seconds"] = time.perf_counter() - start
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--style", choices=["loop", "packed"], default="loop")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (data.manifest=... etc.)")
    args = p.parse_args(argv)
    result = run_ddp(args.overrides, args.workers, args.style)
    for row in result["history"]:
        print({k: round(v, 4) if isinstance(v, float) and math.isfinite(v) else v for k, v in row.items()})
    print("test:", result["test"], f"wall {result['wall_seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
