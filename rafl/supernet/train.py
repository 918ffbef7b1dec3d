"""Progressive-shrinking training of the supernet (Cai et al., "Once-for-All", ICLR 2020, Sec. 3.2).

Phases, in OFA's order, each with its own epochs, learning rate, fresh SGD (Nesterov) optimizer
and per-step cosine schedule:

1. ``full``: the largest network only (max kernel, expand ratio, depth; random resolution).
2. ``kernel``: elastic kernel size (``ks`` from all choices; ``e``, ``d`` at max).
3. ``depth``: elastic depth, widened in two stages as OFA does: the first half of the phase's
   steps samples the two largest depths, the second half all depths.
4. ``expand``: elastic expand ratio (two stages likewise: two largest ratios, then all). The
   phase starts with OFA's channel sorting (``re_organize_middle_weights``, Sec. 3.2).

Every step samples subnets from the phase's allowed choices (optionally the *sandwich rule* of
BigNAS/US-Nets: the largest + the smallest + ``n_subnets`` random ones) and accumulates their
gradients before one optimizer step. Loss per subnet (OFA's ``train_one_epoch``): label-smoothed
cross-entropy + ``kd_ratio`` x soft cross-entropy to the *in-place* teacher, the largest subnet's
detached output on the same batch (in-place distillation, Yu et al., BigNAS, ECCV 2020, Sec. 3.1).

Resume: after every epoch ``resume.pt`` (model, optimizer, scheduler, RNG states of torch / numpy
/ Python and of the run's own generators, progress, metrics) is written atomically; a run resumed
from it ends with the same weights as an uninterrupted one (tested bit-exactly on CPU).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import Tensor
from tqdm.auto import tqdm

from rafl import seeds
from rafl.data import load_dataset
from rafl.errors import UserInputError, load_error_detail
from rafl.folders import RunFolder, RunKind
from rafl.io import atomic_write_bytes, atomic_write_json
from rafl.supernet.arch import WIDTH_MULT_MAX, WIDTH_MULT_MIN, ArchConfig, SearchSpace
from rafl.supernet.checkpoint import META_NAME, read_json_file, save_supernet
from rafl.supernet.distributed import (
    DistContext,
    all_reduce_gradients,
    all_reduce_sum,
    init_distributed,
    shard,
    synced_batch_norm,
)
from rafl.supernet.model import Supernet, build_supernet, extract_subnet, recalibrate_bn
from rafl.supernet.server_data import calibration_sample, cutout, random_crop_flip, server_split

PHASES: tuple[str, ...] = ("full", "kernel", "depth", "expand")
RESUME_NAME = "resume.pt"
#: the largest input resolution (px), as :func:`rafl.data.load_dataset`'s (2000 px was killed for memory at 22 GB)
MAX_RESOLUTION = 1024
CONFIG_NAME = "config.json"
METRICS_NAME = "metrics.json"
# digits are 8x8 images: small resolutions lose nothing; 32 px datasets use OFA-like 24..32
DEFAULT_RESOLUTIONS: dict[str, tuple[int, ...]] = {"digits": (12, 14, 16), "femnist": (20, 24, 28)}


class TrainConfig(BaseModel):
    """Resolved configuration of a supernet training run (the one source of truth for defaults).

    Units: learning rates per step of SGD; epochs are passes over pool-train; resolutions in pixels.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Literal["digits", "cifar10", "cifar100", "femnist"] = "digits"
    data_root: str | None = None
    image_size: int = Field(32, ge=8, le=512, description="resolution the dataset is loaded at (px)")
    limit_per_class: int | None = Field(None, ge=1)
    public_fraction: float = Field(0.3, gt=0, lt=1)
    public_seed: int = 0
    val_fraction: float = Field(0.1, ge=0, lt=1)
    test_samples: int | None = Field(2000, ge=1)

    width_mult: float = Field(0.35, ge=WIDTH_MULT_MIN, le=WIDTH_MULT_MAX, allow_inf_nan=False)
    resolutions: tuple[int, ...] = Field(
        (12, 14, 16), description="elastic input resolutions (px); default per dataset: "
        "digits (8x8 originals) (12, 14, 16), others (24, 28, 32)")
    ks_choices: tuple[int, ...] = (3, 5, 7)
    e_choices: tuple[int, ...] = (3, 4, 6)
    d_choices: tuple[int, ...] = (2, 3, 4)
    stem_stride: int = Field(1, ge=1, le=2)

    epochs_full: int = Field(10, ge=0)
    epochs_kernel: int = Field(3, ge=0)
    epochs_depth: int = Field(3, ge=0)
    epochs_expand: int = Field(4, ge=0)
    lr_full: float = Field(0.05, gt=0)
    lr_kernel: float = Field(0.02, gt=0)
    lr_depth: float = Field(0.02, gt=0)
    lr_expand: float = Field(0.02, gt=0)
    batch_size: int = Field(32, ge=2)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-5, ge=0)
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    kd_ratio: float = Field(1.0, ge=0)
    sandwich: bool = True
    n_subnets: int = Field(1, ge=0, description="random subnets per step besides the sandwich")
    crop_padding: int = Field(4, ge=0)
    hflip: bool | None = Field(None, description="horizontal flips; None = on for CIFAR only")
    cutout: int = Field(0, ge=0, le=64, description="side (px) of the square cut out of every training image "
                                                    "(DeVries & Taylor 2017); 0 = off")
    recal_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(256, ge=1)

    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _dataset_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("resolutions") is None:
            data = {**data, "resolutions": DEFAULT_RESOLUTIONS.get(data.get("dataset", "digits"), (24, 28, 32))}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.dataset != "digits" and self.data_root is None:
            raise ValueError(f"dataset {self.dataset!r} needs a data root: --data-root (config key data_root) "
                             "or $RAFL_DATA_ROOT")
        if sum(self.phase_epochs()) == 0:
            raise ValueError("all phases have 0 epochs")
        if any(not 4 <= r <= MAX_RESOLUTION for r in self.resolutions):  # as the data loaders' bound
            raise ValueError(f"resolutions {list(self.resolutions)}: allowed: integers in 4..{MAX_RESOLUTION} (px)")
        try:  # the search space's own checks (odd kernel sizes, ...) now, so the error names the config file
            self.space(n_classes=10)
        except UserInputError as err:
            key = (err.field or "").removeprefix("search_space.")
            raise ValueError(f"{key}: {err.message}" if key else err.message) from None
        return self

    @classmethod
    def as_recorded_now(cls, recorded: dict[str, Any]) -> dict[str, Any]:
        """A config recorded as JSON (a run's ``config.json``, a shipped supernet's) with every field
        added to :class:`TrainConfig` since set to its default: what that run trained with, in
        today's fields (``cutout`` did not exist before, and 0 is what those runs did)."""
        added = {k: f.default for k, f in cls.model_fields.items() if k not in recorded}
        return json.loads(json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in added.items()})) | recorded

    def phase_epochs(self) -> list[int]:
        """Epochs of (full, kernel, depth, expand)."""
        return [self.epochs_full, self.epochs_kernel, self.epochs_depth, self.epochs_expand]

    def phase_lrs(self) -> list[float]:
        """Learning rates of (full, kernel, depth, expand)."""
        return [self.lr_full, self.lr_kernel, self.lr_depth, self.lr_expand]

    def space(self, n_classes: int) -> SearchSpace:
        """The supernet's :class:`SearchSpace` for a dataset with ``n_classes`` classes."""
        return SearchSpace(ks_choices=self.ks_choices, e_choices=self.e_choices,
                           d_choices=self.d_choices, resolutions=self.resolutions,
                           width_mult=self.width_mult, n_classes=n_classes, stem_stride=self.stem_stride)

    def use_hflip(self) -> bool:
        """Whether horizontal flips are used (default: CIFAR only; digits/letters are not symmetric)."""
        return self.dataset.startswith("cifar") if self.hflip is None else self.hflip

    @classmethod
    def from_options(cls, source: str | Path | None = None, **options: Any) -> TrainConfig:
        """Validate ``options`` (None values = defaults), turning errors into UserInputError.

        ``epochs_per_phase`` sets the epochs of all four phases.
        """
        opts = {k: v for k, v in options.items() if v is not None}
        if opts.get("dataset", "digits") != "digits" and not opts.get("data_root") and os.environ.get("RAFL_DATA_ROOT"):
            opts["data_root"] = os.environ["RAFL_DATA_ROOT"]  # as `rafl data` and the run config take it
        per_phase = opts.pop("epochs_per_phase", None)
        if per_phase is not None:
            for name in PHASES:  # the option overrides a config file's per-phase counts
                opts[f"epochs_{name}"] = per_phase
        try:
            return cls(**opts)
        except ValidationError as err:
            first = err.errors()[0]
            loc = ".".join(str(p) for p in first["loc"]) or "config"
            if first.get("type") == "extra_forbidden":
                raise UserInputError(f"unknown key; allowed: {', '.join(sorted(cls.model_fields))}, epochs_per_phase",
                                     source=source, field=loc) from None
            if per_phase is not None and loc.startswith("epochs_") and options.get(loc) is None:
                loc = "epochs_per_phase"  # the value the user gave, copied into every phase
            msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
            if not first["loc"]:  # a check across fields: its message says what is wrong (no input dump)
                raise UserInputError(msg, source=source, field=None) from None
            info = cls.model_fields.get(loc)
            allowed_text = f"; allowed: {info.description}" if info is not None and info.description else ""
            raise UserInputError(f"{msg} (got {first.get('input')!r}){allowed_text}", source=source,
                                 field=loc) from None


# --------------------------------------------------------------------------------------------
# sampling per phase


def phase_choices(space: SearchSpace, phase: str, stage: int) -> dict[str, tuple[int, ...]]:
    """Allowed (ks, e, d, r) choices in ``phase`` (OFA's progressive shrinking; ``stage`` 0/1 is
    the first/second half of the depth and expand phases)."""
    ks, e, d = space.ks_choices, space.e_choices, space.d_choices
    top = {"ks": (max(ks),), "e": (max(e),), "d": (max(d),)}
    if phase == "full":
        return {**top, "r": space.resolutions}
    if phase == "kernel":
        return {"ks": ks, "e": top["e"], "d": top["d"], "r": space.resolutions}
    if phase == "depth":
        return {"ks": ks, "e": top["e"], "d": d[-2:] if stage == 0 else d, "r": space.resolutions}
    return {"ks": ks, "e": e[-2:] if stage == 0 else e, "d": d, "r": space.resolutions}


def _arch_from(space: SearchSpace, ch: dict[str, tuple[int, ...]], rng: np.random.Generator | None,
               pick: str = "random") -> ArchConfig:
    if pick == "max":
        vals = {k: max(v) for k, v in ch.items()}
        return ArchConfig((vals["ks"],) * space.n_blocks, (vals["e"],) * space.n_blocks,
                          (vals["d"],) * space.n_stages, vals["r"])
    if pick == "min":
        vals = {k: min(v) for k, v in ch.items()}
        return ArchConfig((vals["ks"],) * space.n_blocks, (vals["e"],) * space.n_blocks,
                          (vals["d"],) * space.n_stages, vals["r"]).canonical(space)
    assert rng is not None
    return ArchConfig(tuple(int(v) for v in rng.choice(ch["ks"], space.n_blocks)),
                      tuple(int(v) for v in rng.choice(ch["e"], space.n_blocks)),
                      tuple(int(v) for v in rng.choice(ch["d"], space.n_stages)),
                      int(rng.choice(ch["r"]))).canonical(space)


def sample_step_archs(space: SearchSpace, phase: str, stage: int, rng: np.random.Generator,
                      sandwich: bool, n_subnets: int) -> list[ArchConfig]:
    """The subnets trained in one step; with the sandwich rule the first is the largest (the
    in-place teacher) and the second the smallest of the phase."""
    ch = phase_choices(space, phase, stage)
    if phase == "full":
        return [_arch_from(space, {**ch, "r": (int(rng.choice(ch["r"])),)}, None, "max")]
    archs = [_arch_from(space, ch, None, "max"), _arch_from(space, ch, None, "min")] if sandwich else []
    archs += [_arch_from(space, ch, rng) for _ in range(n_subnets)]
    return archs


def soft_cross_entropy(logits: Tensor, target_probs: Tensor) -> Tensor:
    """Mean over the batch of ``-sum_c p_c log softmax(logits)_c``; ``(B, C), (B, C) -> ()``.

    OFA's KD loss (``ofa.utils.cross_entropy_loss_with_soft_target``).
    """
    return torch.sum(-target_probs * F.log_softmax(logits, dim=1), dim=1).mean()


# --------------------------------------------------------------------------------------------
# training


def _rng_state(np_rng: np.random.Generator, aug_gen: torch.Generator) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy_global": _np_global_state(),
             "python": random.getstate(), "arch_rng": np_rng.bit_generator.state,
             "aug_gen": aug_gen.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _np_global_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _set_rng_state(state: dict[str, Any], np_rng: np.random.Generator, aug_gen: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    g = state["numpy_global"]
    np.random.set_state((g["name"], g["keys"].numpy().astype(np.uint32), g["pos"], g["has_gauss"], g["cached"]))
    random.setstate(_to_tuple(state["python"]))
    np_rng.bit_generator.state = state["arch_rng"]
    aug_gen.set_state(state["aug_gen"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(obj: Any) -> Any:
    return tuple(_to_tuple(o) for o in obj) if isinstance(obj, (list, tuple)) else obj


def _param_groups(net: Supernet, weight_decay: float) -> list[dict[str, Any]]:
    """OFA's ``no_decay_keys='bn#bias'``: no weight decay on BN parameters and biases."""
    decay, no_decay = [], []
    for name, p in net.named_parameters():
        (no_decay if (p.ndim <= 1 or ".bn." in name or name.endswith("bias")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _make_optimizer(net: Supernet, cfg: TrainConfig, phase: int, steps: int):
    opt = torch.optim.SGD(_param_groups(net, cfg.weight_decay), lr=cfg.phase_lrs()[phase],
                          momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    return opt, sched


@torch.no_grad()
def evaluate_subnet(net: Supernet, arch: ArchConfig, images: Tensor, labels: Tensor,
                    calib: list[Tensor], batch_size: int = 256) -> float:
    """Top-1 accuracy (fraction) of subnet ``arch`` after BN recalibration on ``calib`` batches.

    The subnet is extracted (the supernet is not modified). ``images``: ``(N, C, H, W)``,
    ``labels``: ``(N,)``.
    """
    device = next(net.parameters()).device
    sub = extract_subnet(net, arch)
    recalibrate_bn(sub, calib, n_batches=len(calib))
    sub.eval()
    correct = 0
    for i in range(0, len(labels), batch_size):
        x = images[i:i + batch_size].to(device)
        correct += int((sub(x).argmax(1).cpu() == labels[i:i + batch_size]).sum())
    return correct / max(1, len(labels))


def holds_supernet_run(out: str | Path) -> bool:
    """Whether folder ``out`` holds (part of) a ``rafl supernet train`` run: its checkpoint
    (``supernet.json``), its resume state, or a ``config.json`` this command wrote (a
    :class:`TrainConfig`: ``ks_choices``, ``epochs_full``, ...), or an empty one (another run's
    claim). Another tool's ``config.json`` is not a supernet run."""
    out = Path(out)
    if any((out / n).exists() for n in (RESUME_NAME, META_NAME)):
        return True
    try:
        text = (out / CONFIG_NAME).read_text()
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        return True  # unreadable: do not call it foreign (and never write over it)
    if not text.strip():
        return True
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and {"ks_choices", "e_choices", "d_choices", "epochs_full"} <= set(data)


#: a ``rafl supernet train`` run folder as an output folder (:class:`rafl.folders.RunFolder`):
#: ``config.json`` first (:func:`holds_supernet_run`), ``resume.pt`` once an epoch completed and
#: ``supernet.json`` when finished; a new run never takes over a run's folder (``--resume`` restarts
#: one that never completed an epoch)
SUPERNET_RUN = RunKind(
    started=holds_supernet_run,
    completed=lambda p: (p / RESUME_NAME).exists() or (p / META_NAME).exists(),
    foreign="is not empty; allowed: a new or empty folder (or --resume a supernet run)",
    taken="already holds a supernet run; use --resume to continue it or another --out",
    dead="already holds a supernet run; use --resume to continue it or another --out",
    step="epoch")


def _check_out(out: Path, resume: bool) -> bool:
    """Whether to continue from ``out/resume.pt``. Resuming a run that was stopped before its first
    epoch ended (``config.json`` but no checkpoint: killed early, or out of memory) starts it over
    with its saved config; such a folder could otherwise be neither resumed nor reused. A new run
    needs a folder :data:`SUPERNET_RUN` accepts (:meth:`rafl.folders.RunFolder.check_new`)."""
    if resume:
        if (out / RESUME_NAME).is_file():
            return True
        if (out / CONFIG_NAME).is_file() and not (out / META_NAME).exists():
            return False
        raise UserInputError(f"has no {RESUME_NAME} to resume from", source=out, field="resume")
    RunFolder.check_new(out, SUPERNET_RUN, "out")
    return False


def train_supernet(config: TrainConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
                   stop_after_epochs: int | None = None,
                   check_memory: Callable[[TrainConfig, int, torch.device], None] | None = None,
                   ) -> tuple[Supernet, dict[str, Any]]:
    """Train a supernet by progressive shrinking on the server's public pool; write it to ``out``.

    Writes (atomically) ``out/config.json`` (resolved config), ``out/resume.pt`` (after every
    epoch), ``out/metrics.json`` (per-phase metrics, then the final test table) and finally
    ``out/supernet.safetensors`` + ``out/supernet.json`` (:func:`~rafl.supernet.save_supernet`).

    Args:
        config: the run's configuration.
        out: run directory.
        resume: continue from ``out/resume.pt`` (same result as an uninterrupted run).
        progress: show a tqdm bar (phase, epoch, loss, accuracy, ETA).
        stop_after_epochs: stop (checkpointed, unfinished) after this many epochs in total; used to
            test resuming. ``None`` = run to the end.
        check_memory: ``check_memory(config, n_classes, device)`` runs once the dataset is loaded,
            before anything is written; it raises UserInputError for a run that cannot fit the
            device (``rafl supernet train`` passes :func:`rafl.search.cost.check_training_memory`).
            None: no check.

    Returns:
        ``(supernet, metrics)``; metrics has ``phases`` (list of per-phase dicts with per-epoch
        train loss/accuracy; the phase's last epoch adds server-val accuracy ``val_acc_smallest``
        (the space's smallest subnet), ``val_acc_phase_smallest`` (the smallest subnet trained in
        that phase) and ``val_acc_largest``, all BN-recalibrated), and when finished
        ``test`` = {smallest, middle, largest: accuracy} with BN recalibrated on pool-train, and
        ``test_source`` saying which held-out samples were used.

    Raises:
        UserInputError: bad data options, an ``out`` that already holds a run or anything else
            (without ``resume``: :data:`SUPERNET_RUN`), ``resume`` without a checkpoint, an ``out``
            a live run writes into (the writing rank holds it, a :class:`rafl.folders.RunFolder`,
            while it trains), or a NaN/Inf loss (training diverged: the error names the phase's
            learning rate ``lr_<phase>``; a new run's folder is removed first, since its checkpoints
            cannot be resumed with another learning rate).

    A new run that fails before its first epoch completed leaves nothing (its folder is removed,
    or emptied where it was there, empty, before).
    """
    held: list[RunFolder] = []  # the writing rank's run folder, released when training ends
    try:
        return _train_supernet(config, Path(out), resume=resume, progress=progress,
                               stop_after_epochs=stop_after_epochs, check_memory=check_memory, held=held)
    except BaseException as err:
        for run in held:
            if not run.resumed and isinstance(err, UserInputError) and (err.field or "").startswith("lr_"):
                run.discard()  # diverged: its checkpoints cannot be resumed with another lr
            else:
                run.discard_if_incomplete()
        raise
    finally:
        for run in held:
            run.close()


def _train_supernet(config: TrainConfig, out: Path, *, resume: bool, progress: bool, stop_after_epochs: int | None,
                    check_memory: Callable[[TrainConfig, int, torch.device], None] | None,
                    held: list[RunFolder]) -> tuple[Supernet, dict[str, Any]]:
    """:func:`train_supernet` (``held`` gets the run folder once the writing rank holds ``out``)."""
    out = Path(out)
    requested = resume
    if config.device == "cuda" and not torch.cuda.is_available():
        raise UserInputError("is 'cuda' but no CUDA device is available; allowed here: cpu", field="device")
    ctx = init_distributed(config.device, config.batch_size)  # torchrun: one rank of several
    resume = _check_out(out, resume)  # every rank checks before rank 0 writes anything
    if resume and ctx.is_writer:  # a live run of this folder (training, or resumed elsewhere) refuses a second
        held.append(RunFolder.reopen(out, SUPERNET_RUN, field="resume"))
    device = ctx.device(config.device)
    cuda = device.type == "cuda"

    ds = load_dataset(config.dataset, config.data_root, resolution=config.image_size,
                      limit_per_class=config.limit_per_class, progress=progress)
    split = server_split(ds, config.public_fraction, config.public_seed, config.val_fraction,
                         config.test_samples)
    space = config.space(ds.num_classes)
    if check_memory is not None:  # e.g. the cost model's lower bound (rafl.search.cost.check_training_memory)
        check_memory(config, ds.num_classes, device)
    images, labels = ds.images, ds.labels
    train_x, train_y = images.take(split.pool_train), labels[split.pool_train]  # uint8 kept; batches normalized
    n_train = len(train_y)
    steps_per_epoch = math.ceil(n_train / config.batch_size)
    calib_idx = torch.as_tensor(calibration_sample(np.arange(n_train), config.recal_batches * config.batch_size,
                                                   config.seed))  # class-mixed; the training's RNG is not touched
    calib = [train_x[calib_idx[i:i + config.batch_size]] for i in range(0, len(calib_idx), config.batch_size)]

    torch.manual_seed(seeds.int_seed("supernet-weights", config.seed))
    np.random.seed(seeds.int_seed("supernet-numpy-global", config.seed))
    random.seed(seeds.int_seed("supernet-python-random", config.seed))
    arch_rng = seeds.generator("supernet-arch", config.seed)
    aug_gen = torch.Generator().manual_seed(seeds.int_seed("supernet-loader", config.seed))

    net = build_supernet(space).to(device)
    if cuda:
        net = net.to(memory_format=torch.channels_last)
    metrics: dict[str, Any] = {"phases": [], "test_source": split.test_source,
                               "n_pool_train": n_train, "n_pool_val": len(split.pool_val),
                               "n_test": len(split.test), "search_space": space.to_dict()}
    start_phase, start_epoch = 0, 0
    opt = sched = None
    if resume:
        saved_cfg = read_json_file(out / CONFIG_NAME)
        now_cfg = json.loads(config.model_dump_json())
        saved_cfg = TrainConfig.as_recorded_now(saved_cfg)
        diff = [k for k in set(saved_cfg) | set(now_cfg) if k != "device" and saved_cfg.get(k) != now_cfg.get(k)]
        if diff:
            raise UserInputError(f"the run in this directory has another config (fields {diff}); "
                                 "resume with the saved config", source=out / CONFIG_NAME, field="resume")
        try:  # map to CPU: the RNG states must stay CPU tensors
            ckpt = torch.load(out / RESUME_NAME, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
            raise UserInputError(f"cannot read the resume checkpoint ({err.__class__.__name__}; truncated "
                                 "or corrupted?)", source=out / RESUME_NAME) from None
        try:
            net.load_state_dict(ckpt["model"])
        except (RuntimeError, KeyError, TypeError) as err:  # weights of another shape than config.json's
            raise UserInputError(f"its weights do not fit the supernet {CONFIG_NAME} describes "
                                 f"({load_error_detail(err)}); "
                                 f"restore the run's {CONFIG_NAME} or start a new run", source=out / RESUME_NAME,
                                 field="resume") from None
        start_phase, start_epoch = ckpt["phase"], ckpt["epoch"]
        metrics = json.loads(ckpt["metrics_json"])
        if start_epoch > 0:
            opt, sched = _make_optimizer(net, config, start_phase,
                                         config.phase_epochs()[start_phase] * steps_per_epoch)
            opt.load_state_dict(ckpt["optimizer"])
            sched.load_state_dict(ckpt["scheduler"])
        _set_rng_state(ckpt["rng"], arch_rng, aug_gen)
    elif ctx.is_writer:
        # a fresh run claims the folder (a second run started into it stops here) and holds it: a
        # --resume of it while it trains is refused; --resume of a run that never completed an
        # epoch starts it over in its own folder
        held.append(RunFolder.reopen(out, SUPERNET_RUN, field="resume") if requested else
                    RunFolder.start(out, SUPERNET_RUN, field="out", claim=CONFIG_NAME))
        atomic_write_json(out / CONFIG_NAME, json.loads(config.model_dump_json()))
    ctx.barrier()
    params = [p for p in net.parameters() if p.requires_grad]

    epochs = config.phase_epochs()
    total_steps = sum(epochs) * steps_per_epoch
    done_steps = (sum(epochs[:start_phase]) + start_epoch) * steps_per_epoch
    bar = tqdm(total=total_steps, initial=done_steps, disable=not progress or not ctx.is_writer, unit="step",
               dynamic_ncols=True)
    epochs_run = 0
    hflip = config.use_hflip()
    for phase in range(start_phase, len(PHASES)):
        name = PHASES[phase]
        if epochs[phase] == 0:
            continue
        phase_steps = epochs[phase] * steps_per_epoch
        first_epoch = start_epoch if phase == start_phase else 0
        if first_epoch == 0:
            if name == "expand":
                net.re_organize_middle_weights(expand_ratio_stage=0)
            opt, sched = _make_optimizer(net, config, phase, phase_steps)
            metrics["phases"].append({"phase": name, "epochs": [], "lr": config.phase_lrs()[phase]})
        t0 = time.perf_counter()
        for epoch in range(first_epoch, epochs[phase]):
            net.train()
            order = torch.randperm(n_train, generator=aug_gen)
            loss_sum, correct, seen = 0.0, 0, 0
            bar.set_description(f"{name} {epoch + 1}/{epochs[phase]}")
            for step in range(steps_per_epoch):
                idx = order[step * config.batch_size:(step + 1) * config.batch_size]
                x = random_crop_flip(train_x[idx], config.crop_padding, hflip, aug_gen)  # the global batch
                x = cutout(x, config.cutout, aug_gen)
                y = train_y[idx]
                n_global = len(y)
                x, y = shard(x, ctx).to(device), shard(y, ctx).to(device)  # this rank's rows
                if cuda:
                    x = x.contiguous(memory_format=torch.channels_last)
                stage = int(epoch * steps_per_epoch + step >= phase_steps / 2)
                archs = sample_step_archs(space, name, stage, arch_rng, config.sandwich, config.n_subnets)
                opt.zero_grad(set_to_none=True)
                if ctx.distributed:
                    loss_sum, correct, seen = _distributed_step(net, params, space, archs, name, x, y, n_global,
                                                                config, phase, epoch, ctx, cuda,
                                                                (loss_sum, correct, seen))
                else:
                    loss_sum, correct, seen = _step(net, space, archs, name, x, y, config, phase, epoch, cuda,
                                                    (loss_sum, correct, seen))
                opt.step()
                sched.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{correct / seen:.3f}")
            if ctx.distributed:  # each rank counted its own rows' correct predictions
                correct = int(all_reduce_sum([float(correct)], device)[0])
            record = {"epoch": epoch + 1, "train_loss": loss_sum / seen, "train_acc": correct / seen,
                      "seconds": round(time.perf_counter() - t0, 2)}
            if epoch + 1 == epochs[phase] and len(split.pool_val):
                val_x, val_y = images[split.pool_val], labels[split.pool_val]
                phase_min = _arch_from(space, phase_choices(space, name, 1), None, "min")
                for which, arch in (("smallest", space.smallest()), ("phase_smallest", phase_min),
                                    ("largest", space.largest())):
                    record[f"val_acc_{which}"] = evaluate_subnet(net, arch, val_x, val_y, calib,
                                                                 config.eval_batch_size)
            metrics["phases"][-1]["epochs"].append(record)
            epochs_run += 1
            if ctx.is_writer:
                _save_resume(out, net, opt, sched, phase, epoch + 1, metrics, arch_rng, aug_gen)
                atomic_write_json(out / METRICS_NAME, metrics)
            ctx.barrier()
            if stop_after_epochs is not None and epochs_run >= stop_after_epochs \
                    and not (phase == len(PHASES) - 1 and epoch + 1 == epochs[phase]):
                bar.close()
                return net.eval(), metrics
    bar.close()

    net.eval()
    test_x, test_y = images[split.test], labels[split.test]
    metrics["test"] = {which: evaluate_subnet(net, arch, test_x, test_y, calib, config.eval_batch_size)
                       for which, arch in (("smallest", space.smallest()), ("middle", space.middle()),
                                           ("largest", space.largest()))}
    metrics["archs"] = {"smallest": space.smallest().to_string(space), "middle": space.middle().to_string(space),
                        "largest": space.largest().to_string(space)}
    if ctx.is_writer:
        atomic_write_json(out / METRICS_NAME, metrics)
        save_supernet(out, net.to("cpu").to(memory_format=torch.contiguous_format),
                      json.loads(config.model_dump_json()), metrics)
    ctx.barrier()
    return net, metrics


def _diverged(name: str, epoch: int, loss: float, config: TrainConfig, phase: int) -> UserInputError:
    return UserInputError(f"supernet training diverged in phase {name}, epoch {epoch + 1} (loss {loss}); allowed: "
                          f"a smaller lr_{name} (now {config.phase_lrs()[phase]})", field=f"lr_{name}")


def _step(net: Supernet, space: SearchSpace, archs: list[ArchConfig], name: str, x: Tensor, y: Tensor,
          config: TrainConfig, phase: int, epoch: int, cuda: bool,
          totals: tuple[float, int, int]) -> tuple[float, int, int]:
    """One step's forward/backward passes in a single process (gradients accumulate over ``archs``).

    Returns the updated ``(loss_sum, correct, seen)`` of the epoch."""
    loss_sum, correct, seen = totals
    teacher = None
    if name != "full" and config.kd_ratio > 0 and not config.sandwich:
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            teacher = F.softmax(net(x, space.largest()).float(), dim=1)
    for i, arch in enumerate(archs):
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            logits = net(x, arch).float()
        loss = F.cross_entropy(logits, y, label_smoothing=config.label_smoothing)
        if teacher is not None:
            loss = loss + config.kd_ratio * soft_cross_entropy(logits, teacher)
        elif name != "full" and config.kd_ratio > 0 and config.sandwich and i == 0:
            teacher = F.softmax(logits.detach(), dim=1)
        if not bool(torch.isfinite(loss.detach())):
            raise _diverged(name, epoch, float(loss.detach()), config, phase)
        loss.backward()
        loss_sum += float(loss.detach()) * len(y)
        correct += int((logits.detach().argmax(1) == y).sum())
        seen += len(y)
    return loss_sum, correct, seen


def _distributed_step(net: Supernet, params: list[torch.nn.Parameter], space: SearchSpace, archs: list[ArchConfig],
                      name: str, x: Tensor, y: Tensor, n_global: int, config: TrainConfig, phase: int, epoch: int,
                      ctx: DistContext, cuda: bool, totals: tuple[float, int, int]) -> tuple[float, int, int]:
    """:func:`_step` on one rank's rows of a global batch of ``n_global`` samples: the loss is this
    rank's share of the global mean (sum over its rows / ``n_global``), BN uses the global batch's
    statistics, and the gradients (with the losses) are summed over ranks after the last subnet,
    so every rank steps with the single-process gradient (:mod:`rafl.supernet.distributed`).

    Returns the updated ``(loss_sum, correct, seen)``; ``correct`` counts this rank's rows only."""
    loss_sum, correct, seen = totals
    teacher = None
    losses: list[Tensor] = []
    with synced_batch_norm(ctx, n_global):
        if name != "full" and config.kd_ratio > 0 and not config.sandwich:
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                teacher = F.softmax(net(x, space.largest()).float(), dim=1)
        for i, arch in enumerate(archs):
            with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                logits = net(x, arch).float()
            loss = F.cross_entropy(logits, y, label_smoothing=config.label_smoothing, reduction="sum") / n_global
            if teacher is not None:
                loss = loss + config.kd_ratio * torch.sum(-teacher * F.log_softmax(logits, dim=1)) / n_global
            elif name != "full" and config.kd_ratio > 0 and config.sandwich and i == 0:
                teacher = F.softmax(logits.detach(), dim=1)
            loss.backward()
            losses.append(loss.detach().float().reshape(1))
            correct += int((logits.detach().argmax(1) == y).sum())
    total = all_reduce_gradients(params, torch.cat(losses))  # the global mean loss of every subnet
    for value in total.tolist():
        if not math.isfinite(value):
            raise _diverged(name, epoch, value, config, phase)
        loss_sum += value * n_global
        seen += n_global
    return loss_sum, correct, seen



def _save_resume(out: Path, net: Supernet, opt, sched, phase: int, epoch: int, metrics: dict[str, Any],
                 arch_rng: np.random.Generator, aug_gen: torch.Generator) -> None:
    """Atomically write everything needed to continue after (phase, epoch) to ``out/resume.pt``."""
    state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "phase": phase, "epoch": epoch, "metrics_json": json.dumps(metrics),
             "rng": _rng_state(arch_rng, aug_gen)}
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(out / RESUME_NAME, buf.getvalue())


__all__ = ["TrainConfig", "train_supernet", "PHASES", "phase_choices", "sample_step_archs",
           "soft_cross_entropy", "evaluate_subnet"]
