"""The bandwidth benchmark's two workloads and six methods: data, and the config every row shares.

* ``tiles``: ResNet-18 tile encoder + ABMIL trained end to end on tile bags (``model.encoder=resnet18``,
  ``data.kind=tiles``): synthetic slides of ``dpgs demo-data --kind slides``, tiled by ``dpgs tile`` at
  112 px on level 0 (the demo slides are 1536 x 1024 px: 224-px tiles would leave 5-8 tissue tiles a
  slide, 112-px tiles leave 14-38) and resized to 224 px (``data.tile_size=224``), 16 tiles sampled per
  bag, one bag per worker per step (B = 2 with P = 2): 11.7 M parameters, 46 MB of dense float32
  gradients a step. The accuracy question needs a task that takes several epochs: at ``dpgs demo-data``'s
  default contrast and split (24 / 8 / 8 of 40 slides) every method reached validation AUC 1.0 after its
  first epoch, so a time to target measured nothing. The slides' tumour texture is therefore drawn at
  :data:`TILE_TUMOUR_CONTRAST` (``--tumour-contrast``), and of :data:`TILE_SLIDES` i.i.d. slides (one case
  each) :data:`TILE_SPLITS` are assigned to train / val / test (half of each label): the same 12 steps
  an epoch as before, and 24 validation slides (AUC in steps of 1/144, not 1/16).
* ``features``: ABMIL on the digits feature bags of ``dpgs demo-data`` (64-d features), as
  ``configs/demo-dpgs.yaml`` trains it: B = 16, 162 k parameters, 648 kB of dense gradients.

Every row of a workload has the same data, model, seed, batch, learning-rate schedule and epochs; the
method only adds its own settings (:data:`METHODS`). Data is written once into a cache folder (the CLI
commands a user runs) and copied where the hosts read it.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DPGS_METHODS = {
    "dpgs-dense": "1.0",
    "dpgs-keep1": "0.01",
    "dpgs-keep0.1": "0.001",
    "dpgs-auto": "auto",
}
DDP_METHODS = {"ddp": None, "ddp-powersgd": 4}  # PowerSGD rank (None: plain all-reduce)
METHODS = [*DPGS_METHODS, *DDP_METHODS]
TILE_TUMOUR_CONTRAST = 0.4
TILE_SLIDES = 72
TILE_SPLITS = {"train": 24, "val": 24, "test": 24}  # whole runs: 12 steps of B = 2 an epoch
QUICK_STEPS = 4  # --quick: steps of B = P bags, with 2 validation and 2 test slides (both classes)


def quick_splits(workers: int) -> dict[str, int]:
    """The --quick split at P = ``workers``: ``QUICK_STEPS`` steps of one bag per worker."""
    return {"train": QUICK_STEPS * workers, "val": 2, "test": 2}


@dataclass(frozen=True)
class Workload:
    """One workload in one mode (quick: a few steps, no time to target)."""

    name: str  # the row's "workload" (tiles-resnet18 / features-abmil: the scaling model's names)
    key: str  # tiles / features
    quick: bool
    bags: int  # slides or bags written by demo-data
    batch: int  # bags per optimizer step
    epochs: int
    tiles_per_bag: int | None
    overrides: tuple[str, ...]  # config overrides of every row, data paths excluded

    def data_overrides(self, root: str) -> list[str]:
        """The data paths of the config, for the data folder ``root`` as the processes see it."""
        manifest = f"{root}/{self.manifest_name}"
        if self.key == "tiles":
            return ["data.kind=tiles", f"data.manifest={manifest}", f"data.slides_dir={root}/slides",
                    f"data.tiles_dir={root}/tiles"]
        return ["data.kind=features", f"data.manifest={manifest}", f"data.features_dir={root}/features"]

    @property
    def data_dir(self) -> str:
        """The data folder's name (in the cache and on the hosts): the tiles' names their slide count and
        contrast, so a cache written with other ones is never taken for this workload's."""
        return f"tiles-{self.bags}-contrast{TILE_TUMOUR_CONTRAST:g}" if self.key == "tiles" else self.key

    @property
    def manifest_name(self) -> str:
        if self.key == "tiles":
            return f"manifest-quick-B{self.batch}.csv" if self.quick else "manifest-bench.csv"
        return "manifest.csv"



def workload(key: str, quick: bool = False, epochs: int | None = None, workers: int = 2) -> Workload:
    """The workload ``key`` (tiles or features) with P = ``workers``."""
    if key == "tiles":
        batch = workers  # one bag per worker per step
        common = (
            "model.name=abmil", "model.encoder=resnet18", "model.big_stages=-1", "data.tile_size=224",
            "data.tiles_per_bag=16", "data.read_threads=2", "data.augment.enabled=true",
            f"train.batch_size={batch}", "train.optimizer=adam", "train.lr=3e-4", "train.lr_scaling=sqrt",
            "train.scheduler=none", "eval.sample_k=null",
        )
        if quick:
            return Workload("tiles-resnet18", key, True, TILE_SLIDES, batch, 1, 16,
                            (*common, "train.epochs=1", "eval.bootstrap=0"))
        return Workload("tiles-resnet18", key, False, TILE_SLIDES, batch, epochs or 6, 16,
                        (*common, f"train.epochs={epochs or 6}"))
    if key == "features":
        common = ("model.name=abmil", "train.batch_size=16", "train.optimizer=adam", "train.lr=5e-4",
                  "train.lr_scaling=sqrt", "train.scheduler=cosine")
        e = epochs or (2 if quick else 10)
        return Workload("features-abmil", key, quick, 1000, 16, e, None, (*common, f"train.epochs={e}"))
    raise ValueError(f"unknown workload {key!r}: expected tiles or features")


def method_overrides(method: str, quick: bool) -> list[str]:
    """Config overrides of a DPGS method (quick runs skip the keep-ratio warm-up: their few steps
    measure the steady ratio)."""
    if method not in DPGS_METHODS:
        raise ValueError(f"{method} is not a dpgs method ({', '.join(DPGS_METHODS)})")
    out = ["train.mode=dpgs", f"dpgs.compression.keep_ratio={DPGS_METHODS[method]}"]
    return out + (["dpgs.compression.warmup_epochs=0"] if quick else [])


def dpgs_cli() -> str:
    return str(Path(sys.executable).parent / "dpgs")


def prepare(w: Workload, cache: Path, log=print) -> Path:
    """The workload's data in ``cache`` (written once, with the commands a user runs); returns the folder."""
    folder = cache / w.data_dir
    done = folder / ".complete"
    if not done.exists():
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        if w.key == "tiles":
            _run([dpgs_cli(), "demo-data", str(folder), "--kind", "slides", "--bags", str(w.bags),
                  "--seed", "0", "--tumour-contrast", str(TILE_TUMOUR_CONTRAST)], log)
            _run([dpgs_cli(), "tile", str(folder / "slides"), str(folder / "tiles"), "--tile-size", "112",
                  "--level", "0", "--no-progress"], log)
        else:
            _run([dpgs_cli(), "demo-data", str(folder), "--bags", str(w.bags), "--seed", "0"], log)
        done.write_text("ok\n")
    if w.key == "tiles" and not (folder / w.manifest_name).exists():
        write_split_manifest(folder / "manifest.csv", folder / w.manifest_name,
                             quick_splits(w.batch) if w.quick else TILE_SPLITS)
    return folder


def write_split_manifest(source: Path, out: Path, splits: dict[str, int]) -> None:
    """``source``'s slides in the order written, reassigned: per label, the first ``splits[s] // 2`` not
    yet taken go to split ``s`` (in the order of ``splits``); the rest are left out. For the synthetic
    slides only, whose slides are i.i.d. draws with one case each (no patient shared across splits)."""
    with source.open() as f:
        rows = list(csv.DictReader(f))
    picked = []
    for label in ("0", "1"):
        of = [r for r in rows if r["label"] == label]
        need = sum(n // 2 for n in splits.values())
        if len(of) < need:
            raise ValueError(f"{source}: only {len(of)} slides of label {label}, need {need}")
        for split, n in splits.items():
            picked += [{**r, "split": split} for r in of[: n // 2]]
            of = of[n // 2:]
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(picked)


def _run(argv: list[str], log) -> None:
    log("$ " + " ".join(argv))
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr[-2000:]}")
