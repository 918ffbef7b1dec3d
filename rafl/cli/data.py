"""``rafl data``: load a dataset, partition it over federated clients, write partition.json + heat map."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.cli._types import data_root_option


@click.command("data")
@click.option("--dataset", default="digits", show_default=True,
              help="digits (embedded, offline) | cifar10 | cifar100 | femnist.")
@data_root_option()
@click.option("--clients", type=int, default=None,
              help="Number of clients [default: 20; natural: one per eligible writer].")
@click.option("--partition", "scheme", default="dirichlet", show_default=True,
              help="iid | pathological | dirichlet | balanced-dirichlet (equal client sizes) | natural | file:PATH (a saved "
                   "partition.json).")
@click.option("--k", type=int, default=None, help="Classes per client (pathological), 1..C.")
@click.option("--alpha", type=float, default=0.5, show_default=True,
              help="Dirichlet concentration (> 0; smaller = more label skew).")
@click.option("--min-samples", type=int, default=10, show_default=True,
              help="Smallest client (dirichlet redraws; balanced-dirichlet: <= samples/clients) / smallest writer kept "
                   "(natural).")
@click.option("--public-fraction", type=float, default=0.0, show_default=True,
              help="Share of every class carved first into the server's public pool, 0 <= f < 1.")
@click.option("--public-seed", type=int, default=0, show_default=True, help="Seed of the public pool.")
@click.option("--split", "split_text", default="8:1:1", show_default=True,
              help="Per-client train:val:test ratio.")
@click.option("--seed", type=int, default=0, show_default=True, help="Partition seed.")
@click.option("--resolution", type=int, default=32, show_default=True, help="Image size in pixels.")
@click.option("--limit-per-class", type=int, default=None,
              help="Keep only the first N samples per class and source split (quick runs).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/data"), show_default=True,
              help="Output folder (created atomically; a previous `rafl data` output is replaced).")
@click.option("--quiet", "--no-progress", "quiet", is_flag=True, help="No progress bars (reading a dataset source).")
def data(dataset: str, data_root: Path | None, clients: int | None, scheme: str, k: int | None, alpha: float,
         min_samples: int, public_fraction: float, public_seed: int, split_text: str, seed: int, resolution: int,
         limit_per_class: int | None, out: Path, quiet: bool) -> None:
    """Partition a dataset over federated clients.

    Prints a per-client table (samples per split, classes held) and writes OUT/partition.json
    (client id -> train/val/test index lists, the public pool, meta) and OUT/class_heatmap.png
    (clients x classes sample counts). Reuse the split anywhere with --partition file:OUT/partition.json.
    """
    from rafl.stages.data_checks import SHAPING_OPTIONS, check_options

    # ---- validate every option before touching data or disk (and before torch loads)
    ctx = click.get_current_context()
    given = [param for param in SHAPING_OPTIONS
             if ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE]
    clients, split = check_options(dataset, scheme, data_root=data_root, clients=clients, k=k, alpha=alpha,
                                   min_samples=min_samples, public_fraction=public_fraction, public_seed=public_seed,
                                   split_text=split_text, seed=seed, out=out, given=given)

    # ---- load and partition (raise UserInputError on bad data; nothing is written yet)
    from rafl.stages import data as stage

    made = stage.partition_dataset(dataset, scheme, clients, seed, split, data_root=data_root, k=k, alpha=alpha,
                                   min_samples=min_samples, public_fraction=public_fraction, public_seed=public_seed,
                                   resolution=resolution, limit_per_class=limit_per_class, progress=not quiet)
    from rafl.data.report import print_partition_table

    print_partition_table(made.partition, made.labels, made.ds.classes)

    # ---- write atomically: everything lands under OUT at once, or nothing does
    stage.write_partition(out, made)
    click.echo(f"wrote {out / 'partition.json'} and {out / 'class_heatmap.png'}")
