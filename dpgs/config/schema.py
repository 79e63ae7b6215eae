"""The dpgs configuration schema.

Every section forbids unknown keys, so a typo (``train.batch_sz``) is an error naming the key instead of
a silently ignored setting. Numbers must be finite (``train.lr=inf`` is refused) and a boolean is not a
number (``train.batch_size=true`` is refused, where pydantic alone would read it as 1). Defaults are the
values a newcomer should start from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _accepts_bool(annotation: Any) -> bool:
    return annotation is bool or any(_accepts_bool(arg) for arg in get_args(annotation))


class Section(BaseModel):
    """Base of all sections: unknown keys, wrong types, inf/NaN and booleans given as numbers are rejected."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_non_bool(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and not _accepts_bool(annotation):
            expected = annotation.__name__ if isinstance(annotation, type) else str(annotation)
            raise ValueError(
                f"expected {expected}, got the boolean {str(value).lower()} (YAML reads true/false/yes/no/on/"
                "off as booleans; quote the value if it is text)"
            )
        return value


class AugmentSection(Section):
    """Per-slide augmentation of tile bags (one parameter set per bag, ``dpgs.wsi.augment``)."""

    enabled: bool = True
    flips: bool = True
    rotations: bool = True
    color: Literal["hed", "hsv", "none"] = "hed"
    hed_alpha: float = Field(0.05, ge=0, lt=1)
    hed_beta: float = Field(0.05, ge=0, lt=1)
    hue: float = Field(0.04, ge=0, lt=1)
    saturation: float = Field(0.2, ge=0, lt=1)
    brightness: float = Field(0.2, ge=0, lt=1)
    blur_probability: float = Field(0.5, ge=0, le=1)
    blur_sigma: tuple[float, float] = (0.1, 1.0)


class DataConfig(Section):
    kind: Literal["features", "tiles"] = Field(
        "features", description="features: precomputed feature bags; tiles: tiles read from the slides"
    )
    manifest: Path | None = None
    features_dir: Path | None = Field(None, description="feature bags (plain, CLAM or TRIDENT layout)")
    encoder: str | None = Field(None, description="TRIDENT features_<encoder> directory to use")
    split_file: Path | None = Field(None, description="CLAM splits_k.csv (columns train,val,test)")
    folds: int = Field(1, ge=1, description="K-fold cross-validation when > 1")
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    cache_gb: float = Field(2.0, gt=0, description="bounded in-memory bag cache")
    prefetch: int = Field(2, ge=0, description="batches loaded ahead in a background thread")
    slides_dir: Path | None = Field(None, description="data.kind=tiles: the slides ({slide_id}.svs|tif|...)")
    tiles_dir: Path | None = Field(None, description="data.kind=tiles: output of `dpgs tile` (coords h5)")
    tiles_per_bag: int | None = Field(
        256, ge=1, description="tiles sampled per bag per training epoch (null: all tiles)"
    )
    tile_size: int | None = Field(None, ge=8, description="resize tiles to this size (null: patch_size)")
    read_threads: int = Field(4, ge=1, description="threads reading the tiles of one bag")
    augment: AugmentSection = Field(default_factory=AugmentSection)


class ModelConfig(Section):
    name: str = "abmil"
    params: dict[str, Any] = Field(default_factory=dict, description="head hyper-parameters")
    encoder: Literal["resnet18", "resnet50"] | None = Field(
        None, description="tile encoder (data.kind=tiles); its output feeds the head"
    )
    big_stages: int = Field(
        -1, ge=-1, le=4, description="encoder stages run as big layers (-1: dense; raise if bags do not fit)"
    )
    max_elements: int = Field(1 << 24, ge=1, description="largest device tensor of one big-layer strip")
    encoder_weights: Path | None = Field(None, description="torchvision-format ResNet state_dict (.pth)")
    freeze_encoder: bool = Field(False, description="frozen baseline: no encoder gradients, eval-mode BN")
    embed_chunk: int = Field(256, ge=1, description="tiles per encoder pass when no gradient is needed")
    amp: bool = Field(False, description="bfloat16 autocast for the tile encoder (head and loss in fp32)")


class EarlyStoppingConfig(Section):
    patience: int = Field(0, ge=0, description="epochs without improvement before stopping (0: off)")
    monitor: str = "val_auc"
    mode: Literal["max", "min"] = "max"


class TrainConfig(Section):
    mode: Literal["classic", "padding", "sampling", "packed", "dpgs"] = "packed"
    epochs: int = Field(20, ge=1)
    batch_size: int = Field(16, ge=1, description="bags per optimizer step (classic uses 1)")
    sample_size: int = Field(64, ge=1, description="instances per bag in mode=sampling")
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(2e-4, gt=0, description="learning rate at lr_reference_batch bags per step")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "sqrt", description="scale lr with bags per optimizer step relative to lr_reference_batch "
        "(sqrt: measured best for Adam, docs/convergence.md)"
    )
    lr_reference_batch: int = Field(1, ge=1, description="bags per step that train.lr was chosen for")
    warmup_epochs: float = Field(
        0.0, ge=0, description="linear learning-rate warm-up, in epochs (measured: helps from B=64 or with "
        "linear scaling, not at B <= 32 with sqrt)"
    )
    weight_decay: float = Field(1e-5, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    scheduler: Literal["none", "cosine", "step", "exponential"] = "cosine"
    step_size: int = Field(10, ge=1, description="epochs per decay for scheduler=step")
    gamma: float = Field(0.5, gt=0, le=1, description="decay factor for step / exponential")
    accumulation_steps: int = Field(1, ge=1)
    grad_clip: float | None = Field(None, gt=0, description="clip the global gradient norm")
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    class_weighted_loss: bool = False
    output_dir: Path = Path("runs/latest")
    checkpoint_every: int = Field(
        0, ge=0, description="optimizer steps between checkpoints within an epoch, in every mode (0: at each "
        "epoch's end only)"
    )
    device: str = "auto"
    deterministic: bool = False


class EvalConfig(Section):
    """Evaluation protocols (docs/evaluation.md): test on all instances and, with ``sample_k``, also on K
    sampled instances x ``repeats``; validation (checkpoint selection) on all instances or, with
    ``val_sample_k``, on K sampled instances x ``val_repeats``; bootstrap intervals of test metrics."""

    sample_k: int | None = Field(None, ge=1, description="also test with K sampled instances per bag")
    repeats: int = Field(5, ge=1, description="repetitions of the sampled test protocol")
    val_sample_k: int | None = Field(
        None, ge=1, description="validate (select checkpoints) on K sampled instances per bag (null: all)"
    )
    val_repeats: int = Field(1, ge=1, description="repetitions of the sampled validation protocol")
    bootstrap: int = Field(
        1000, ge=0, description="stratified bootstrap resamples for test confidence intervals (0: none)"
    )
    ci_level: float = Field(0.95, gt=0, lt=1, description="confidence level of the bootstrap intervals")


class TrackingConfig(Section):
    uri: str = "sqlite:///mlflow.db"
    run_name: str | None = None


class CompressionConfig(Section):
    """DPGS gradient compression; the defaults are the measured ones of docs/convergence.md."""

    keep_ratio: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = Field(
        "auto", description="fraction of gradient entries sent (1: dense); auto: chosen each epoch from the "
        "measured link and compute (dpgs.distributed.schedule)"
    )
    auto_ratios: tuple[Annotated[float, Field(gt=0, le=1)], ...] = Field(
        (1.0, 0.3, 0.1, 0.01), min_length=1, description="keep_ratio=auto chooses among these (0.001 learns "
        "a tile encoder too slowly in short runs: docs/dpgs.md)"
    )
    auto_share: float = Field(
        0.1, gt=0, lt=1, description="keep_ratio=auto: the largest ratio whose exchange costs at most this "
        "share of a step's compute (1 when the dense exchange does)"
    )
    auto_min_saving: float = Field(
        0.25, ge=0, lt=1, description="keep_ratio=auto compresses only where a compressed step is at least "
        "this share shorter than a dense one (a compressed step learns less; docs/dpgs.md)"
    )
    auto_warmup_share: float = Field(
        2.0, ge=0, description="keep_ratio=auto runs the warm-up epochs (warmup_epochs) dense where the "
        "dense exchange costs at most this multiple of a step's compute (0: never); early steps are where "
        "compression loses most of what a step learns (docs/dpgs.md)"
    )
    ranking: Literal["magnitude", "tensor_rms"] = Field(
        "tensor_rms", description="which entries the workers' top-k keeps: tensor_rms: the largest |g| "
        "relative to the RMS of their tensor (every tensor sends about its share); magnitude: the largest "
        "|g| of the whole model (DMGC, DGC)"
    )
    second_moment: Literal["auto", "live", "frozen"] = Field(
        "auto", description="frozen: after the warm-up epochs (run dense), Adam's second moment is frozen "
        "and the workers compress gradients preconditioned by it, so error feedback is exact under Adam "
        "(1-bit Adam's split; dpgs.train.frozen_adam, docs/convergence.md); live: the master's Adam takes "
        "the compressed gradients; auto: frozen where it applies (a MIL head: feature bags or a frozen "
        "encoder; Adam or AdamW; downlink=gradients; no clipping; warmup_epochs >= 1), else live, "
        "resolved when the config is loaded; with keep_ratio=auto where frozen applies, it stays auto and "
        "the run freezes at its first compressed step if every step before it was dense "
        "(dpgs.distributed.schedule)"
    )
    second_moment_floor: float = Field(
        1.0, ge=0, description="second_moment=frozen: no coordinate's frozen sqrt(v) below this multiple of "
        "its tensor's median"
    )
    value_dtype: Literal["fp32", "fp16", "bf16"] = "fp16"
    clip_norm: float | None = Field(None, gt=0)
    zstd_level: int = Field(3, ge=1, le=22)
    momentum_correction: float | None = Field(None, ge=0, lt=1)
    warmup_epochs: int = Field(
        2, ge=0, description="DGC keep-ratio warm-up epochs (25%, 6.25%, ... then keep_ratio; 0: off)"
    )
    dense_min_numel: int = Field(1024, ge=0, description="tensors smaller than this are sent dense")
    dense_sync_every: int = Field(100, ge=1)
    downlink: Literal["gradients", "delta"] = Field(
        "gradients",
        description="gradients: workers receive the step's compressed gradients and take the master's "
        "optimizer step themselves (exact replicas); delta: the master sends top-k weight deltas with its "
        "own residual",
    )
    wire: Literal["dmgc", "dgc"] = Field(
        "dmgc", description="dmgc: our codec; dgc: raw int32 indices + values, no entropy coding (baseline)"
    )


class DpgsConfig(Section):
    workers: int = Field(2, ge=1)
    transport: Literal["auto", "gloo", "ray"] = Field(
        "auto", description="gloo: a torch.distributed group of master and workers; ray: object refs; "
        "auto: gloo, else ray"
    )
    address: str | None = Field(None, description="unset: local Ray; 'auto' or host:port: join")
    gpus_per_worker: float | None = Field(None, ge=0, le=8)
    cpus_per_worker: float | None = Field(None, gt=0)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    call_timeout_s: float = Field(600.0, gt=0)
    max_worker_restarts: int = Field(3, ge=0)
    emulate_bandwidth_mbps: float | None = Field(None, gt=0)
    resume: Path | None = Field(None, description="DPGS checkpoint to continue from (set by --resume)")
    dashboard: bool = False
    object_store_gb: float | None = Field(None, gt=0)
    sample_parallel: int = Field(
        1, ge=1, description="G ranks per logical worker, splitting every tile of a bag (data.kind=tiles)"
    )
    sample_grid: tuple[int, int] | None = Field(
        None, description="[rows, cols] grid of a group's ranks (rows * cols = sample_parallel; null: [G, 1])"
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "checkpoint_every" in data:
            raise ValueError(
                "dpgs.checkpoint_every is now train.checkpoint_every (every mode writes checkpoints within "
                f"an epoch): set train.checkpoint_every={data['checkpoint_every']}"
            )
        return data

    @model_validator(mode="after")
    def _check_sample_grid(self) -> DpgsConfig:
        if self.sample_grid is not None:
            rows, cols = self.sample_grid
            if rows < 1 or cols < 1 or rows * cols != self.sample_parallel:
                raise ValueError(
                    f"dpgs.sample_grid {list(self.sample_grid)} must be [rows, cols] with rows, cols >= 1 "
                    f"and rows * cols = dpgs.sample_parallel={self.sample_parallel}"
                )
        return self


class Config(Section):
    experiment: str = "dpgs"
    seed: int = 0
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    dpgs: DpgsConfig = Field(default_factory=DpgsConfig)

    @model_validator(mode="after")
    def _check_data_sources(self) -> Config:
        data, model = self.data, self.model
        if data.kind == "features":
            if data.features_dir is None and data.manifest is not None:
                raise ValueError("data.features_dir is required when data.kind=features")
            if model.encoder is not None:
                raise ValueError(
                    f"model.encoder={model.encoder} needs data.kind=tiles (feature bags are already encoded)"
                )
        else:
            if data.manifest is not None and (data.slides_dir is None or data.tiles_dir is None):
                raise ValueError("data.slides_dir and data.tiles_dir are required when data.kind=tiles")
            if model.encoder is None:
                raise ValueError("data.kind=tiles needs a tile encoder: set model.encoder=resnet18|resnet50")
        if model.encoder_weights is not None and model.encoder is None:
            raise ValueError("model.encoder_weights is set but model.encoder is not")
        momentum = self.dpgs.compression.momentum_correction
        if momentum is not None and (self.train.optimizer != "sgd" or self.train.momentum > 0):
            raise ValueError(
                f"dpgs.compression.momentum_correction={momentum:g} applies momentum on the workers (DGC), "
                f"so the master must take plain SGD steps: train.optimizer={self.train.optimizer}, "
                f"train.momentum={self.train.momentum:g} would apply momentum twice; set train.optimizer=sgd "
                "and train.momentum=0, or unset momentum_correction"
            )
        comp = self.dpgs.compression
        clashes = [f"{key}={value}" for key, value, bad in [
            ("train.optimizer", self.train.optimizer, self.train.optimizer not in ("adam", "adamw")),
            ("dpgs.compression.downlink", comp.downlink, comp.downlink != "gradients"),
            ("train.grad_clip", self.train.grad_clip, self.train.grad_clip is not None),
            ("dpgs.compression.clip_norm", comp.clip_norm, comp.clip_norm is not None),
            ("dpgs.compression.warmup_epochs", comp.warmup_epochs, comp.warmup_epochs == 0),
        ] if bad]
        trained_encoder = model.encoder is not None and not model.freeze_encoder
        if comp.second_moment == "auto" and (clashes or trained_encoder or comp.keep_ratio != "auto"):
            # resolved here; left to the keep schedule only where auto chooses the ratio (and frozen applies)
            comp.second_moment = "live" if clashes or trained_encoder else "frozen"
        if comp.second_moment == "frozen":
            if clashes:
                raise ValueError(
                    "dpgs.compression.second_moment=frozen freezes Adam's second moment after dense warm-up "
                    "epochs and needs train.optimizer=adam|adamw, dpgs.compression.downlink=gradients, no "
                    "gradient clipping and dpgs.compression.warmup_epochs >= 1; got " + ", ".join(clashes)
                )
            if trained_encoder:
                raise ValueError(
                    f"dpgs.compression.second_moment=frozen with model.encoder={model.encoder} trained end "
                    "to end (model.freeze_encoder=false): a frozen second moment let a trained ResNet-18's "
                    "loss diverge in its fourth frozen epoch (docs/convergence.md); use it for MIL heads "
                    "(feature bags, or model.freeze_encoder=true), or second_moment=live"
                )
        g = self.dpgs.sample_parallel
        if g > 1:
            if self.train.mode != "dpgs":
                raise ValueError(f"dpgs.sample_parallel={g} needs train.mode=dpgs (got {self.train.mode})")
            if data.kind != "tiles":
                raise ValueError(
                    f"dpgs.sample_parallel={g} needs data.kind=tiles (feature bags have nothing spatial to "
                    "split)"
                )
            if model.freeze_encoder:
                raise ValueError(
                    f"dpgs.sample_parallel={g} trains the encoder across the ranks; it cannot be combined "
                    "with model.freeze_encoder=true (use dpgs.sample_parallel=1)"
                )
            if model.amp:
                raise ValueError(
                    f"dpgs.sample_parallel={g} runs the encoder's ranks in float32; model.amp=true (bfloat16 "
                    "autocast) is not supported with it"
                )
        if self.train.checkpoint_every and not self.writes_checkpoints:
            raise ValueError(
                f"train.checkpoint_every={self.train.checkpoint_every} writes checkpoints within an epoch, "
                f"which single-split runs write: a data.folds={data.folds} command writes none (--resume "
                "continues it fold by fold); set train.checkpoint_every=0"
            )
        return self

    @property
    def writes_checkpoints(self) -> bool:
        """Whether a run (of any mode) writes a checkpoint every epoch (``--resume`` continues it from the
        last): single-split runs (``data.folds=1``). A k-fold command writes none; ``--resume`` keeps its
        finished folds and trains the others again (``dpgs.train.kfold_progress``)."""
        return self.data.folds == 1
