"""Evaluation at whole-slide scale: wall time and peak host memory of scoring N bags.

    python benchmarks/evaluation.py [--workloads features,tiles] [--paths driver,whole-bag]
                                    [--bags 400] [--slides 20] [--slide-size 1536x1024] [--tile-size 32]
                                    [--tile-level 1] [--embed-chunk 256] [--sample-k K --repeats R]
                                    [--device cpu] [--out docs/benchmarks/evaluation.md]

Workloads (a random-weight model: the cost of evaluation does not depend on the weights):

* ``features``: ``--bags`` demo digits bags (``dpgs demo-data``), ABMIL, every bag scored;
* ``tiles``: ``--slides`` synthetic slides tiled like ``make demo-tiles`` (``--tile-size`` px at
  ``--tile-level``; raise ``--slide-size`` and ``--tile-size`` for larger bags), ResNet-18 with
  ``big_stages=1`` + ABMIL, the manifest's test slides.

Paths:

* ``driver``: :func:`dpgs.train.evaluate.score_bags` on this process, one shard holding every bag (tile
  bags streamed from the slide in chunks of ``model.embed_chunk`` tiles; the driver path of training
  and ``dpgs eval``);
* ``whole-bag`` (tile bags only): the same function with every bag read whole first
  (:class:`~dpgs.train.evaluate.WholeBags`: a tile bag becomes one float32 [N, 3, s, s] tensor, which is
  how evaluation worked before issue 17). Feature bags are always read whole ([N, D] is small), so for
  them this is the driver path;
* ``workers``: P = ``--workers`` DPGS worker processes, each scoring a shard, merged on the driver
  (:func:`workers_evaluation`; the pool is started before the timing). Memory figures add up the driver
  and the worker processes.

The data files are read once before the measurements (warm page cache for every path). Each
measurement runs in a fresh Python process (``--child``): setup (imports, data, model), a warm-up on one
instance of the first bag, then the timed evaluation of all bags. Reported: wall seconds of the
evaluation, bags per second, the peak resident set size of the process over its whole life (``VmHWM``
of ``/proc/self/status``, which includes torch, the data and the model; ``ru_maxrss`` is not used
because Linux carries it over from the parent across ``exec``), and the growth during the evaluation:
the high-water mark is reset when the evaluation starts (``/proc/self/clear_refs``), so the growth is
the peak RSS during the evaluation minus the RSS when it started, i.e. what scoring the bags added on
top of setup. With ``--runs N`` every measurement is repeated in N fresh processes and the medians
are reported (wall times on a shared machine are noisy). Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import emit, machine_line

WORKLOADS = ("features", "tiles")
PATHS = ("driver", "whole-bag", "workers")
MEASURED = ("seconds", "peak_mib", "growth_mib")


def memory_mib(field: str, pid: int | str = "self") -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since start or the last reset) of a process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/{pid}/status has no {field} (the benchmark needs Linux)")


def reset_peak_rss(pid: int | str = "self") -> None:
    """Reset a process's ``VmHWM`` to its current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# ---------------------------------------------------------------------- data and configs (parent process)


def feature_config(work: Path, bags: int, device: str) -> Path:
    """Demo bags and the config that reads them (a tiny bag cache: every bag is read from its file)."""
    from dpgs.config import load_config, save_config
    from dpgs.data import write_demo_data

    manifest = write_demo_data(work / "demo", bags=bags, seed=0)
    features = manifest.parent / "features"
    config = load_config(None, [f"data.manifest={manifest}", f"data.features_dir={features}",
                                "model.name=abmil", f"train.device={device}", "data.cache_gb=0.001"])
    save_config(config, work / "features.yaml")
    return work / "features.yaml"


def tile_config(work: Path, args) -> Path:
    """Synthetic slides, their tiles, and the config of a ResNet-18 + ABMIL tile model over them."""
    from dpgs.config import load_config, save_config
    from dpgs.wsi.synthetic import write_synthetic_slides
    from dpgs.wsi.tiling import TilingParams, tile_directory

    width, height = (int(v) for v in args.slide_size.lower().split("x"))
    manifest = write_synthetic_slides(work / "slides", n_slides=args.slides, seed=0, size=(width, height))
    tiles = work / "tiles"
    params = TilingParams(tile_size=args.tile_size, level=args.tile_level)
    tile_directory(manifest.parent / "slides", tiles, params, progress=False)
    config = load_config(None, [
        "data.kind=tiles", f"data.manifest={manifest}", f"data.slides_dir={manifest.parent / 'slides'}",
        f"data.tiles_dir={tiles}", "model.name=abmil", "model.encoder=resnet18", "model.big_stages=1",
        f"model.embed_chunk={args.embed_chunk}", f"train.device={args.device}",
    ])
    save_config(config, work / "tiles.yaml")
    return work / "tiles.yaml"


# ---------------------------------------------------------------------- one measurement (child process)


def workers_evaluation(config, data, model, indices: list[int], protocol, workers: int):
    """A DPGS worker pool of ``workers`` actors (started and warmed up here, outside the timing) and the
    call that scores ``indices`` on it: ``evaluate_on_workers`` ships the weights, each worker scores its
    shard (balanced by instance counts) with ``score_bags``, the driver merges. Returns (call, pids of
    the worker processes)."""
    import ray

    from dpgs.distributed.runtime import connect
    from dpgs.distributed.session import start_workers
    from dpgs.distributed.sharded_eval import evaluate_on_workers
    from dpgs.modeling import ModelSpec
    from dpgs.runner import dpgs_roles
    from dpgs.train.evaluate import EvalProtocol

    config = config.model_copy(update={
        "train": config.train.model_copy(update={"mode": "dpgs"}),
        "dpgs": config.dpgs.model_copy(update={"workers": workers}),
    })
    in_dim = None if config.model.encoder else data.dataset.feature_dim
    spec = ModelSpec(config.model, in_dim, len(data.manifest.classes))
    connect(config.dpgs)
    roles = dpgs_roles(config)
    actors = start_workers(roles, config, spec, data.dataset, roles.worker.launch(config))
    state, lengths = model.state_dict(), data.eval_dataset.lengths()

    def on_driver(shard):
        raise RuntimeError(f"a worker failed while scoring {shard}")

    warm_up = EvalProtocol(1, 1, 0)
    evaluate_on_workers(actors, state, indices[:workers], warm_up, lengths, on_driver)
    pids = ray.get(actors.call("ping"))
    return (lambda: evaluate_on_workers(actors, state, indices, protocol, lengths, on_driver)), pids


def measure(spec: dict) -> dict:
    """Set up, warm up on one bag, then time the evaluation of every bag (runs in a fresh process)."""
    import torch

    from dpgs.config import load_config
    from dpgs.experiment import load_experiment_data
    from dpgs.modeling import ModelSpec, resolve_device
    from dpgs.train.evaluate import EvalProtocol, WholeBags, score_bags

    config = load_config(spec["config"])
    data = load_experiment_data(config.data, seed=config.seed)
    indices = data.splits[0].test if config.data.kind == "tiles" else list(range(len(data.manifest.records)))
    torch.manual_seed(0)
    in_dim = None if config.model.encoder else data.dataset.feature_dim
    device = resolve_device(config.train.device)
    model = ModelSpec(config.model, in_dim, len(data.manifest.classes)).build().to(device).eval()
    protocol = EvalProtocol.sampled(spec["sample_k"], spec["repeats"], 0)
    source = WholeBags(data.eval_dataset) if spec["path"] == "whole-bag" else data.eval_dataset
    score_bags(model, source, indices[:1], EvalProtocol(1, 1, 0), device)  # warm-up on one instance
    pids: list[int] = []
    if spec["path"] == "workers":
        evaluate, pids = workers_evaluation(config, data, model, indices, protocol, spec["workers"])
    else:
        evaluate = lambda: score_bags(model, source, indices, protocol, device)  # noqa: E731
    processes = ["self", *pids]  # the workers' memory counts too: it is host memory of the same machine
    peak_setup = sum(memory_mib("VmHWM", p) for p in processes)
    for p in processes:
        reset_peak_rss(p)
    before = sum(memory_mib("VmRSS", p) for p in processes)
    start = time.perf_counter()
    evaluate()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    lengths = data.eval_dataset.tile_counts() if config.data.kind == "tiles" else data.dataset.lengths()
    peak_eval = sum(memory_mib("VmHWM", p) for p in processes)
    return {"bags": len(indices), "instances": sum(lengths[i] for i in indices), "seconds": seconds,
            "peak_mib": max(peak_setup, peak_eval), "growth_mib": peak_eval - before}


def warm_page_cache(root: Path) -> None:
    """Read every file under ``root`` once, so that no path pays for cold disk reads."""
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as fh:
                while fh.read(1 << 24):
                    pass


def run_child(spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measurement {spec['workload']}/{spec['path']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    header = ["workload", "path", "bags", "instances", "wall s", "bags/s", "peak RSS MiB",
              "RSS growth during eval MiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["workload"], r["path"], str(r["bags"]), str(r["instances"]), f"{r['seconds']:.2f}",
                 f"{r['bags'] / r['seconds']:.1f}", f"{r['peak_mib']:.0f}", f"{r['growth_mib']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="features,tiles", help=f"comma-separated of {', '.join(WORKLOADS)}")
    p.add_argument("--paths", default="driver,whole-bag", help=f"comma-separated of {', '.join(PATHS)}")
    p.add_argument("--bags", type=int, default=400, help="demo feature bags")
    p.add_argument("--slides", type=int, default=20, help="synthetic slides (the test split is evaluated)")
    p.add_argument("--slide-size", default="1536x1024", help="level-0 WIDTHxHEIGHT of the synthetic slides")
    p.add_argument("--tile-size", type=int, default=32)
    p.add_argument("--tile-level", type=int, default=1)
    p.add_argument("--embed-chunk", type=int, default=256, help="model.embed_chunk of the tile model")
    p.add_argument("--sample-k", type=int, default=None, help="score K sampled instances x --repeats")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workers", type=int, default=2, help="P for the workers path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--runs", type=int, default=1, help="fresh processes per measurement (medians reported)")
    p.add_argument("--work", help="working directory (default: a temporary one)")
    p.add_argument("--out", help="also write the report to this Markdown file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    workloads, paths = args.workloads.split(","), args.paths.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS] + [q for q in paths if q not in PATHS]
    if unknown:
        p.error(f"unknown workload or path: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        configs = {}
        if "features" in workloads:
            configs["features"] = feature_config(work, args.bags, args.device)
        if "tiles" in workloads:
            configs["tiles"] = tile_config(work, args)
        warm_page_cache(work)
        rows = []
        for workload, config in configs.items():
            for path in paths:
                if workload == "features" and path == "whole-bag":
                    continue  # the driver path already reads feature bags whole
                spec = {"workload": workload, "path": path, "config": str(config), "sample_k": args.sample_k,
                        "repeats": args.repeats, "workers": args.workers}
                runs = [run_child(spec) for _ in range(args.runs)]
                medians = {k: float(np.median([r[k] for r in runs])) for k in MEASURED}
                rows.append({"workload": workload, "path": path, **runs[0], **medians})
    described = {
        "features": f"{args.bags} demo feature bags (ABMIL)",
        "tiles": f"the test slides of {args.slides} synthetic slides {args.slide_size} tiled at "
                 f"{args.tile_size} px, level {args.tile_level} (ResNet-18 big_stages=1 + ABMIL, "
                 f"embed_chunk {args.embed_chunk})",
    }
    protocol = "all instances" if args.sample_k is None else f"K={args.sample_k} x {args.repeats}"
    text = (f"Evaluation of {' and of '.join(described[w] for w in configs)}; protocol: {protocol}; device "
            f"{args.device}; median of {args.runs} run(s). {machine_line()}.\n\n{table(rows)}")
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
