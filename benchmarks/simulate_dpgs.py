"""Screening: the DPGS step of P workers simulated in one process with the runtime's own parts.

    python benchmarks/simulate_dpgs.py --bags 400 --seed 0 [--epochs 8] [key=value overrides ...]

Per step, the bags are spread over P workers by the runtime's LPT assignment; each worker back-propagates
the sum of its bags' losses (``dpgs.train.steps.batch_loss``, packed) on a copy of the model, encodes it
with its own :class:`dpgs.distributed.codec.Uplink` (its error-feedback residual), the messages are summed
by another ``Uplink`` as the master does and one :class:`Replica` steps with the runtime's optimizer,
learning rate (``learning_rate``) and keep ratio (``dpgs.distributed.schedule.KeepSchedule``; a
fixed ratio: ``auto`` measures a real link, which a simulation does not have). No Ray, no transport, no
dropout seeding as the workers do (``second_moment=frozen`` freezes and preconditions as
``RelaySync`` does): for screening settings only; final figures come from ``dpgs train``
(``benchmarks/short_runs.py``). Prints the validation AUC per epoch and the test AUC of the last epoch.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from sklearn.metrics import roc_auc_score

from dpgs.compression import ParamLayout
from dpgs.config import load_config
from dpgs.data import write_demo_data
from dpgs.distributed.assignment import assign_lpt
from dpgs.distributed.codec import Uplink
from dpgs.distributed.flat import flat_grads, load_flat_params
from dpgs.distributed.frames import as_part
from dpgs.distributed.replica import Replica
from dpgs.distributed.schedule import KeepSchedule
from dpgs.experiment import load_experiment_data
from dpgs.modeling import ModelSpec
from dpgs.train.batching import epoch_batches
from dpgs.train.optim import learning_rate
from dpgs.train.steps import batch_loss

ROOT = Path(__file__).resolve().parents[1]


def auc(model, dataset, indices) -> float:
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for i in indices:
            bag = dataset[i]
            scores.append(float(torch.softmax(model(bag.features), 0)[1]))
            labels.append(bag.label)
    return float(roc_auc_score(labels, scores))


def simulate(config) -> list[float]:
    torch.set_num_threads(1)
    data = load_experiment_data(config.data, seed=config.seed)
    split = data.splits[0]
    spec = ModelSpec(config.model, data.dataset.feature_dim, len(data.manifest.classes))
    torch.manual_seed(config.seed)
    model = spec.build()
    workers = config.dpgs.workers
    cfg = config.dpgs.compression
    if cfg.keep_ratio == "auto":
        raise SystemExit("simulate_dpgs.py needs a fixed dpgs.compression.keep_ratio (auto measures a link)")
    replica = Replica(model, config.train)
    replica.restart(model.state_dict(), with_optimizer=True)
    worker_models = [copy.deepcopy(model) for _ in range(workers)]
    layout = ParamLayout.from_module(model, dense_min_numel=cfg.dense_min_numel)
    encoders = [Uplink(cfg, layout) for _ in range(workers)]
    decoder = Uplink(cfg, layout)
    schedule = KeepSchedule(cfg)
    lengths = data.dataset.lengths()
    curve = []
    for epoch in range(1, config.train.epochs + 1):
        batches = epoch_batches(list(split.train), config.train.batch_size, config.seed, epoch)
        for s, batch in enumerate(batches):
            lr = learning_rate(config.train, epoch, s, len(batches))
            keep = schedule.ratio(epoch)
            if cfg.second_moment == "frozen" and keep < 1.0:  # as every rank does (RelaySync)
                replica.freeze_second_moment(cfg.second_moment_floor)
            plan = assign_lpt([lengths[i] for i in batch], workers)
            params = replica.flat_params()
            payloads, counts = [], []
            for w, positions in enumerate(plan):
                bags = [data.dataset[batch[p]] for p in positions]
                counts.append(len(bags))
                if not bags:
                    payloads.append(as_part(None))
                    continue
                m = worker_models[w]
                load_flat_params(m, params)
                m.train()
                m.zero_grad(set_to_none=True)
                labels = torch.tensor([b.label for b in bags])
                out = batch_loss(m, [b.features for b in bags], labels, "dpgs")
                out["per_bag"].sum().backward()
                grad = flat_grads(m)
                if replica.frozen:
                    grad = grad / replica.preconditioner()
                payloads.append(as_part(encoders[w].encode(grad, keep)))
            total = decoder.sum_into(torch.zeros(replica.numel), payloads, counts, keep)
            replica.step(total.div_(len(batch)), lr, 1.0)
        curve.append(auc(model, data.dataset, split.val))
        print(f"epoch {epoch}: val AUC {curve[-1]:.4f}", flush=True)
    print(f"test AUC {auc(model, data.dataset, split.test):.4f}")
    return curve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bags", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--work", default="/tmp/dpgs-short-runs")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    root = Path(args.work) / f"bags{args.bags}-seed{args.seed}"
    if not (root / "manifest.csv").is_file():
        write_demo_data(root, bags=args.bags, seed=args.seed)
    config = load_config(ROOT / "configs" / "demo.yaml", [
        f"data.manifest={root / 'manifest.csv'}", f"data.features_dir={root / 'features'}", "train.mode=dpgs",
        "dpgs.workers=2", "train.batch_size=16", f"train.epochs={args.epochs}", f"seed={args.seed}",
        "data.prefetch=0", *args.overrides])
    curve = simulate(config)
    print("best", f"{max(curve):.4f}", "curve", " ".join(f"{v:.3f}" for v in curve))
    return 0 if all(math.isfinite(v) for v in curve) else 1


if __name__ == "__main__":
    sys.exit(main())
