"""``rafl supernet train``: progressive-shrinking training of the OFA MobileNet-V3 supernet."""

from __future__ import annotations

import json
from pathlib import Path

import click

from rafl.errors import UserInputError
from rafl.supernet.arch import WIDTH_MULT_MAX, WIDTH_MULT_MIN


def _parse_ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    from rafl.supernet.train import MAX_RESOLUTION

    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(","))  # an empty item ("12,,14") is an error
    except ValueError:
        values = ()
    if not values or any(not 4 <= v <= MAX_RESOLUTION for v in values):
        raise UserInputError(f"is {text!r}, allowed: comma-separated integers in 4..{MAX_RESOLUTION} like 16,20,24",
                             field=option)
    return values


@click.group("supernet")
def supernet() -> None:
    """Train and inspect the once-for-all supernet."""


@supernet.command("train")
@click.option("--dataset", default=None, help="digits | cifar10 | cifar100 | femnist  [default: digits]")
@click.option("--data-root", type=click.Path(path_type=Path), default=None,
              help="Where cifar10/cifar100/femnist are (not needed for digits).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run folder (checkpoint, config.json, metrics.json). Required unless --resume.")
@click.option("--epochs-per-phase", type=int, default=None,
              help="Epochs of every phase: one N for all 4 (full, kernel, depth, expand)  "
                   "[default: 10, 3, 3, 4].")
@click.option("--device", default=None, help="cpu | cuda  [default: cpu]")
@click.option("--seed", type=int, default=None, help="Run seed [default: 0].")
@click.option("--width-mult", type=float, default=None,  # TrainConfig checks the bounds
              help=f"Supernet width multiplier, {WIDTH_MULT_MIN:g}..{WIDTH_MULT_MAX:g} [default: 0.35].")
@click.option("--resolutions", default=None, help="Elastic input resolutions in px [default: digits 12,14,16; others 24,28,32].")
@click.option("--batch-size", type=int, default=None, help="Mini-batch size [default: 32].")
@click.option("--limit-per-class", type=int, default=None, help="Use only N samples per class (quick runs).")
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None,
              help="YAML/JSON file with any TrainConfig fields (options given here override it).")
@click.option("--preset", default=None,
              help="A shipped recipe as the base config (options given here override it): cifar10 = the "
                   "recipe of the pretrained CIFAR-10 supernet (`rafl search --supernet cifar10`).")
@click.option("--resume", type=click.Path(path_type=Path), default=None,
              help="Continue the interrupted run in this folder (same result as an uninterrupted run).")
@click.option("--no-progress", "--quiet", "no_progress", is_flag=True, help="Hide the progress bar.")
def train(dataset, data_root, out, epochs_per_phase, device, seed, width_mult, resolutions, batch_size,
          limit_per_class, config_file, preset, resume, no_progress) -> None:
    """Train a supernet by progressive shrinking on the server's public pool.

    Phases full -> elastic kernel -> elastic depth -> elastic expand (OFA's order). Writes
    OUT/config.json (resolved config), OUT/resume.pt after every epoch, OUT/metrics.json and
    finally OUT/supernet.safetensors + OUT/supernet.json; ends with a table of test accuracy
    (BN recalibrated) of the smallest, middle and largest subnets.

    Beyond one process: `torchrun --nproc_per_node=N -m rafl supernet train ...` (gloo on CPU,
    NCCL on CUDA; --batch-size is the global batch, a multiple of N; only rank 0 writes).
    """
    import os

    rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0  # torchrun's rank
    try:
        _train(dataset, data_root, out, epochs_per_phase, device, seed, width_mult, resolutions, batch_size,
               limit_per_class, config_file, preset, resume, no_progress, rank)
    except UserInputError:
        if rank > 0:  # every rank meets the same error: rank 0 alone says it
            raise SystemExit(2) from None
        raise


def _train(dataset, data_root, out, epochs_per_phase, device, seed, width_mult, resolutions, batch_size,
           limit_per_class, config_file, preset, resume, no_progress, rank: int) -> None:
    import yaml

    from rafl.io import load_yaml
    from rafl.search.cost import check_training_memory
    from rafl.supernet.train import CONFIG_NAME, TrainConfig, holds_supernet_run, train_supernet

    # paths are recorded absolute (config.json), so --resume works from any folder: --data-root
    # against the current folder, a config file's data_root against the file's folder
    options = {"dataset": dataset, "data_root": None if data_root is None else str(data_root.expanduser().resolve()),
               "epochs_per_phase": epochs_per_phase, "device": device, "seed": seed, "width_mult": width_mult,
               "resolutions": _parse_ints(resolutions, "--resolutions"), "batch_size": batch_size,
               "limit_per_class": limit_per_class}
    given = {k: v for k, v in options.items() if v is not None}
    if resume is not None and config_file is not None:
        raise UserInputError("cannot be combined with --resume (the run folder's config.json is used)",
                             field="--config")
    if preset is not None:
        from rafl.supernet.presets import preset_path

        if resume is not None:
            raise UserInputError("cannot be combined with --resume (the run folder's config.json is used)",
                                 field="--preset")
        if config_file is not None:
            raise UserInputError("cannot be combined with --config (a preset is a config file: copy it from "
                                 f"{preset_path(preset)} and edit it)", field="--preset")
        config_file = preset_path(preset)
    base: dict = {}
    source: Path | None = None
    if config_file is not None:
        if not config_file.is_file():
            raise UserInputError("no such file", source=config_file, field="--config")
        try:
            base = load_yaml(config_file.read_text(), config_file) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            raise UserInputError("not valid YAML/JSON", source=config_file, field="--config") from None
        if not isinstance(base, dict):
            raise UserInputError("expected a mapping of TrainConfig fields", source=config_file, field="--config")
        if isinstance(base.get("data_root"), str) and base["data_root"]:
            base["data_root"] = str((config_file.parent / Path(base["data_root"]).expanduser()).resolve())
        source = config_file
    if resume is not None:
        if not resume.exists():
            raise UserInputError("does not exist", source=resume, field="--resume")
        if out is not None and out.resolve() != resume.resolve():
            raise UserInputError(f"is {out}, but --resume continues the run in {resume}; omit --out",
                                 field="--out")
        out = resume
        saved = resume / CONFIG_NAME
        if not saved.is_file():
            raise UserInputError(f"has no {CONFIG_NAME}: not a `rafl supernet train` run folder",
                                 source=resume, field="--resume")
        if not holds_supernet_run(resume):  # another tool's config.json: --resume would start a run there
            raise UserInputError(f"its {CONFIG_NAME} was not written by `rafl supernet train` (no ks_choices, "
                                 "epochs_full, ...): not a supernet run folder", source=saved, field="--resume")
        try:
            base = json.loads(saved.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserInputError("not valid JSON (truncated or corrupted?)", source=saved, field="--resume") from None
        source = saved
        per_phase = given.pop("epochs_per_phase", None)
        if per_phase is not None:
            given.update({f"epochs_{p}": per_phase for p in ("full", "kernel", "depth", "expand")})
        changed = [k for k, v in given.items() if k != "device" and base.get(k) != (list(v) if isinstance(v, tuple) else v)]
        if changed:
            raise UserInputError(f"option(s) {changed} differ from the saved run's config; --resume continues "
                                 "with the saved config (only --device may change)", source=saved, field="--resume")
    if out is None:
        raise UserInputError("is required (the run folder to write)", field="--out")
    if out.exists() and not out.is_dir():
        raise UserInputError("exists and is not a folder", source=out, field="--out")
    if resume is None and out.is_dir() and any(out.iterdir()) and not holds_supernet_run(out):
        raise UserInputError("is not empty; allowed: a new or empty folder (or --resume a supernet run)",
                             source=out, field="--out")
    config = TrainConfig.from_options(source=source, **{**base, **given})

    fresh = resume is None and (not out.exists() or not any(out.iterdir()))
    existed = out.exists()
    try:
        _, metrics = train_supernet(config, out, resume=resume is not None, progress=not no_progress,
                                    check_memory=check_training_memory)
    except UserInputError as err:
        if fresh and rank == 0 and (err.field or "").startswith("lr_"):  # diverged: its checkpoints cannot be resumed
            import shutil  # with another lr, so leave nothing behind

            if existed:
                for child in out.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            else:
                shutil.rmtree(out, ignore_errors=True)
        raise
    if rank == 0:
        _print_table(metrics, out)


def _print_table(metrics: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"supernet test accuracy (BN recalibrated on pool-train; {metrics['test_source']})")
    table.add_column("subnet")
    table.add_column("arch")
    table.add_column("test acc", justify="right")
    for which in ("smallest", "middle", "largest"):
        table.add_row(which, metrics["archs"][which], f"{100 * metrics['test'][which]:.2f}%")
    console = Console()
    console.print(table)
    if (out / "config.json").is_file():
        console.print(f"run folder {out}: supernet.safetensors, supernet.json, config.json, metrics.json")


@supernet.command("info")
@click.argument("path", type=click.Path(path_type=Path))
def info(path: Path) -> None:
    """Describe a trained supernet: search space, feature width D, size, metrics.

    PATH is a `rafl supernet train` run folder (or its supernet.json), or the name of a shipped
    supernet (cifar10).
    """
    from rich.console import Console
    from rich.table import Table

    from rafl.supernet.arch import SearchSpace, log10_num_subnets
    from rafl.supernet.checkpoint import load_meta, load_supernet
    from rafl.supernet.pretrained import is_pretrained_name, pretrained_path
    from rafl.supernet.quickstart import supernet_path

    if is_pretrained_name(str(path)):
        path = pretrained_path(str(path))
    path = supernet_path(path, "PATH")  # `quickstart`: the cached quickstart supernet's folder
    meta = load_meta(path)
    if not isinstance(meta, dict) or "search_space" not in meta:
        raise UserInputError("is not a supernet.json written by `rafl supernet train`", source=path)
    space = SearchSpace.from_dict(meta["search_space"], source=path)
    folder = path if path.is_dir() else path.parent
    load_supernet(folder)  # verifies the weights (checksum, every tensor's shape, finite values)
    console = Console()
    console.print(f"search space: ks {list(space.ks_choices)}, e {list(space.e_choices)}, d {list(space.d_choices)}, "
                  f"r {list(space.resolutions)} px; width_mult {space.width_mult}; {space.n_classes} classes; "
                  f"10^{log10_num_subnets(space):.1f} subnets")
    console.print(f"feature width D = {meta.get('feature_dim')}; weights {meta.get('weights_bytes', 0) / 2**20:.1f} MiB")
    metrics = meta.get("metrics") or {}
    if metrics.get("phases"):
        table = Table(title="progressive shrinking (server-val accuracy at the end of each phase)")
        for col in ("phase", "epochs", "lr", "train acc", "val smallest", "val largest"):
            table.add_column(col, justify="right" if col != "phase" else "left")
        for phase in metrics["phases"]:
            last = phase["epochs"][-1]
            table.add_row(phase["phase"], str(len(phase["epochs"])), f"{phase['lr']:g}",
                          f"{last['train_acc']:.3f}", f"{last.get('val_acc_smallest', float('nan')):.3f}",
                          f"{last.get('val_acc_largest', float('nan')):.3f}")
        console.print(table)
    if metrics.get("test"):
        _print_table(metrics, Path(path))
