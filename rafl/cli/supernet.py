"""``rafl supernet train``: progressive-shrinking training of the OFA MobileNet-V3 supernet."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.cli._types import data_root_option
from rafl.errors import UserInputError
from rafl.supernet.arch import WIDTH_MULT_MAX, WIDTH_MULT_MIN


@click.group("supernet")
def supernet() -> None:
    """Train and inspect the once-for-all supernet."""


@supernet.command("train")
@click.option("--dataset", default=None, help="digits | cifar10 | cifar100 | femnist  [default: digits]")
@data_root_option("Config key data_root.")
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
    if resume is None and config_file is None and preset is None:  # the data root before torch loads
        from rafl.stages.checks import check_supernet_data

        check_supernet_data(dataset, data_root)
    from rafl.stages import supernet as stage

    try:
        run_dir, metrics = stage.train(
            out, dataset=dataset, data_root=data_root, epochs_per_phase=epochs_per_phase, device=device, seed=seed,
            width_mult=width_mult, resolutions=stage.parse_resolutions(resolutions, "--resolutions"),
            batch_size=batch_size, limit_per_class=limit_per_class, config_file=config_file, preset=preset,
            resume=resume, progress=not no_progress)
    except UserInputError:
        # every rank says it: torchrun stops the other ranks as soon as one exits, so a rank left
        # silent could be the only one that got to say it (the same line at most once per rank)
        raise
    if rank == 0:
        _print_table(metrics, run_dir)


def _print_table(metrics: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"supernet test accuracy (BN recalibrated on pool-train; {metrics['test_source']})")
    table.add_column("subnet")
    table.add_column("arch", overflow="fold")  # the whole arch string, folded onto more lines when narrow
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
    supernet (cifar10, cifar10-proxy5k).
    """
    from rich.console import Console
    from rich.table import Table

    from rafl.stages.supernet import describe
    from rafl.supernet.arch import log10_num_subnets

    found = describe(path, "PATH")
    path, space, meta = found.path, found.space, found.meta
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
