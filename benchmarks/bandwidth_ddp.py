"""One rank of the bandwidth benchmark's DDP rows: PyTorch DDP over gloo, one process per host.

    python benchmarks/bandwidth_ddp.py --rank R --world P --master ADDR --port PORT --out DIR \
        [--powersgd-rank 4] [--threads 1] -- OVERRIDES...

Started once per worker host (the lab) or per process (loopback) with the same arguments but ``--rank``;
rank 0 hosts the rendezvous (a ``TCPStore`` at ADDR:PORT). Set ``GLOO_SOCKET_IFNAME`` to the host's
interface: the lab's host names resolve nowhere.

The training is ``benchmarks/ddp_baseline.py``'s (its ``BagLoss``, the step composition, dpgs's learning
rate schedule and optimizer), extended for hosts and for the benchmark's measurements:

* **Steps.** Each optimizer step takes the epoch's next B bags (``epoch_batches``), spread over the ranks
  by length (LPT, as DPGS spreads them over its workers); each rank runs one packed forward/backward of
  its bags on ``(P / B) * sum of per-bag losses``, so DDP's average is the mean per-bag gradient of the
  step, as a DPGS step's. The next step's bags are read in a thread while the current one computes (as
  DPGS workers read ahead). With ``--powersgd-rank r`` torch's PowerSGD hook (rank r, error feedback,
  warm start) compresses the all-reduce from step ``POWERSGD_START`` on; the steps before are plain
  all-reduces (torch's rule), and the benchmark measures after them. Each bucket's PowerSGD exchange
  completes before the next bucket's starts (:func:`ordered_powersgd_hook`).
* **Evaluation** as ``dpgs train`` evaluates (``dpgs.train.evaluate.score_bags``: every instance, a
  trained tile encoder with each bag's own BatchNorm statistics), the bags sharded over the ranks by
  length as DPGS shards them over its workers; rank 0 merges the predictions and computes the metrics.
  Validation after every epoch; the test set with the weights of the best epoch by the config's
  ``train.early_stopping.monitor``, with dpgs's bootstrap intervals (``EvalPlan``).
* **Record** (rank 0, ``DIR/ddp.json``): per step its wall-clock start and end (``time.time()``, the
  clock of the benchmark's counter sampler), per epoch its metrics, ``train_seconds`` and
  ``elapsed_seconds`` (from the end of set-up, validation included, as dpgs counts it), and the test
  metrics.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from ddp_baseline import BagLoss
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from dpgs.config import load_config
from dpgs.distributed.assignment import assign_lpt
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec, initial_model
from dpgs.train.batching import epoch_batches
from dpgs.train.evaluate import EvalPlan, Predictions, score_bags, validation_protocol
from dpgs.train.optim import build_optimizer, learning_rate
from dpgs.train.trainer import is_improvement, seed_everything

POWERSGD_START = 2  # torch's PowerSGDState needs start_powerSGD_iter > 1 with error feedback / warm start


def ordered_powersgd_hook(state, bucket):  # no annotations: DDP refuses any but the evaluated Future[Tensor]
    """torch's PowerSGD hook, finished before the next bucket's starts.

    The hook issues its second and third all-reduces (P, then Q) from the callbacks of the previous one,
    which gloo runs on its own threads: with several buckets (ResNet-18 has three) the ranks issued them
    in different orders, a collective mismatch that ended runs at random steps (gloo: "Received data size
    doesn't match expected size"). Waiting here makes the order the buckets' order on every rank; the
    exchange then no longer overlaps the rest of the backward pass."""
    done = torch.futures.Future()
    done.set_result(powersgd.powerSGD_hook(state, bucket).wait())
    return done


def shard(indices: list[int], lengths, world: int, rank: int) -> list[int]:
    """This rank's bags of ``indices`` (LPT on instance counts, as DPGS shards evaluation)."""
    plan = assign_lpt([lengths[i] for i in indices], world)
    return [indices[p] for p in plan[rank]]


def evaluate(model, eval_dataset, indices: list[int], protocol, world: int, rank: int) -> Predictions | None:
    """Every rank scores its shard; rank 0 returns the merged predictions (the others None)."""
    mine = shard(indices, eval_dataset.lengths(), world, rank)
    part = score_bags(model, eval_dataset, mine, protocol, torch.device("cpu"))
    parts = [None] * world if rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    return Predictions.merge(parts, indices) if rank == 0 else None


def train(args, overrides: list[str]) -> dict | None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore(args.master, args.port, args.world, args.rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=1800))
    rank, world = args.rank, args.world
    config = load_config(None, overrides)
    seed_everything(config.seed, config.train.deterministic)
    data = load_experiment_data(config.data, seed=config.seed)
    split, dataset, eval_dataset = data.splits[0], data.dataset, data.eval_dataset
    in_dim = None if config.model.encoder else dataset.feature_dim
    model = initial_model(ModelSpec(config.model, in_dim, len(data.manifest.classes)))
    ddp = torch.nn.parallel.DistributedDataParallel(BagLoss(model))  # broadcasts rank 0's weights
    if args.powersgd_rank:
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=POWERSGD_START)
        ddp.register_comm_hook(state, ordered_powersgd_hook)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, config.train)
    lengths = dataset.lengths()
    cfg = config.train
    monitor, mode = cfg.early_stopping.monitor, cfg.early_stopping.mode
    val_protocol = validation_protocol(config.eval, config.seed)
    history, steps = [], []
    best_value, best_state, best_epoch = None, None, 0
    reader = ThreadPoolExecutor(1)
    dist.barrier()
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        epoch_start = time.perf_counter()
        batches = epoch_batches(split.train, cfg.batch_size, config.seed, epoch)
        mine = [[batch[p] for p in assign_lpt([lengths[i] for i in batch], world)[rank]] for batch in batches]

        def read(s: int, mine=mine, epoch=epoch) -> list:
            return [dataset.get(i, epoch) for i in mine[s]]

        ahead = reader.submit(read, 0)
        loss_sum = 0.0
        for s, batch in enumerate(batches):
            bags = ahead.result()
            if s + 1 < len(batches):
                ahead = reader.submit(read, s + 1)
            t0 = time.time()
            labels = torch.tensor([b.label for b in bags])
            per_bag = ddp([b.features for b in bags], labels)
            (per_bag.sum() * (world / len(batch))).backward()
            loss_sum += float(per_bag.detach().sum())
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg, epoch, s, len(batches))
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"epoch": epoch, "step_in_epoch": s, "start": t0, "end": time.time()})
        row = {"epoch": epoch, "train_seconds": time.perf_counter() - epoch_start}
        losses = [None] * world if rank == 0 else None
        dist.gather_object(loss_sum, losses, dst=0)
        if split.val:
            predictions = evaluate(model, eval_dataset, split.val, val_protocol, world, rank)
            if rank == 0:
                row.update(predictions.metrics("val_"))
        row["epoch_seconds"] = time.perf_counter() - epoch_start
        row["elapsed_seconds"] = time.perf_counter() - start
        if rank == 0:
            row["train_loss"] = sum(losses) / len(split.train)
            history.append(row)
            value = row.get(monitor)
            if is_improvement(value, best_value, mode) if split.val else True:
                best_value, best_epoch = value, epoch
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            print(f"[ddp] epoch {epoch}/{cfg.epochs} " + ", ".join(
                f"{k}={v:.4f}" for k, v in row.items() if k.startswith(("train_loss", "val_"))), flush=True)
    reader.shutdown()
    # every rank tests the best epoch's weights (rank 0 holds them)
    holder = [best_state if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    model.load_state_dict(holder[0])
    test = {}
    if split.test:
        plan = EvalPlan.from_config(config.eval, config.seed)
        predictions = [evaluate(model, eval_dataset, split.test, p, world, rank) for p in plan.protocols]
        if rank == 0:
            test = plan.metrics(predictions)
    dist.destroy_process_group()
    if rank != 0:
        return None
    test["best_epoch"] = best_epoch
    return {"history": history, "steps": steps, "test": test,
            "powersgd_start": POWERSGD_START if args.powersgd_rank else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="address of rank 0 (the rendezvous)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="folder of rank 0's ddp.json")
    p.add_argument("--powersgd-rank", type=int, default=0, help="PowerSGD rank (0: plain all-reduce)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, as dpgs train takes them")
    args = p.parse_args(argv)
    result = train(args, args.overrides)
    if result is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tmp = args.out / "ddp.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.out / "ddp.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
