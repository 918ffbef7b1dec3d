"""``rafl data``: load a dataset, partition it over federated clients, write partition.json + heat map."""

from __future__ import annotations

import math
from pathlib import Path

import click

from rafl.cli._types import data_root_option
from rafl.errors import UserInputError, allowed

OUT_FILES = ("partition.json", "class_heatmap.png")


#: :func:`rafl.data.make_partition`'s argument names -> this command's options, for its errors
PARTITION_OPTIONS = {"k": "--k", "alpha": "--alpha", "min_samples": "--min-samples", "n_clients": "--clients",
                     "public_fraction": "--public-fraction", "split": "--split", "partition": "--partition"}


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserInputError("exists and is not a folder", source=out, field="--out")
    if out.is_dir() and any(out.iterdir()) and not (out / "partition.json").is_file():
        raise UserInputError("is a non-empty folder that is not a previous `rafl data` output; "
                             "choose a new or empty folder", source=out, field="--out")


def _parse_split(text: str) -> tuple[float, float, float]:
    try:
        vals = tuple(float(v) for v in text.replace(":", ",").split(","))
    except ValueError:
        vals = ()
    if len(vals) != 3 or any(v < 0 or math.isnan(v) for v in vals) or vals[0] <= 0 or sum(vals) <= 0:
        raise UserInputError(f"is {text!r}, allowed: three non-negative numbers train:val:test with train > 0, "
                             "like 8:1:1 or 0.8,0.1,0.1",
                             field="--split")
    total = sum(vals)
    return tuple(v / total for v in vals)  # type: ignore[return-value]


@click.command("data")
@click.option("--dataset", default="digits", show_default=True,
              help="digits (embedded, offline) | cifar10 | cifar100 | femnist.")
@data_root_option()
@click.option("--clients", type=int, default=None,
              help="Number of clients [default: 20; natural: one per eligible writer].")
@click.option("--partition", "scheme", default="dirichlet", show_default=True,
              help="iid | pathological | dirichlet | natural | file:PATH (a saved partition.json).")
@click.option("--k", type=int, default=None, help="Classes per client (pathological), 1..C.")
@click.option("--alpha", type=float, default=0.5, show_default=True,
              help="Dirichlet concentration (> 0; smaller = more label skew).")
@click.option("--min-samples", type=int, default=10, show_default=True,
              help="Smallest client (dirichlet redraws) / smallest writer kept (natural).")
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
    from rafl.data import DATASETS, SCHEMES

    # ---- validate every option before touching data or disk
    if dataset not in DATASETS:
        raise UserInputError(f"is {dataset!r}, allowed: {allowed(DATASETS)}", field="--dataset")
    if not (scheme in SCHEMES or scheme.startswith("file:")):
        raise UserInputError(f"is {scheme!r}, allowed: {allowed([*SCHEMES, 'file:PATH'])}", field="--partition")
    if scheme.startswith("file:") and not Path(scheme[5:]).is_file():
        raise UserInputError("partition file not found", source=scheme[5:], field="--partition")
    if scheme.startswith("file:"):  # a saved split is used as saved: an option that would shape one is a slip
        ctx = click.get_current_context()
        shaping = {"clients": "--clients", "k": "--k", "alpha": "--alpha", "min_samples": "--min-samples",
                   "public_fraction": "--public-fraction", "public_seed": "--public-seed", "split_text": "--split",
                   "seed": "--seed"}
        given = [flag for param, flag in shaping.items()
                 if ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise UserInputError(f"is only used to make a partition; --partition {scheme} is used as saved (its "
                                 "clients, pool and splits)", field=given[0])
    if clients is None and scheme != "natural":
        clients = 20
    if clients is not None and clients <= 0:
        raise UserInputError(f"is {clients}, allowed: an integer >= 1", field="--clients")
    if k is not None and scheme != "pathological":
        raise UserInputError(f"is only used with --partition pathological (got --partition {scheme})", field="--k")
    if scheme == "pathological":
        if k is None:
            raise UserInputError("is required with --partition pathological (classes per client, 1..C)", field="--k")
        if k <= 0:
            raise UserInputError(f"is {k}, allowed: an integer 1..C (number of classes)", field="--k")
    if scheme == "dirichlet" and not (alpha > 0 and math.isfinite(alpha)):
        raise UserInputError(f"is {alpha}, allowed: a finite number > 0", field="--alpha")
    if min_samples < 1:
        raise UserInputError(f"is {min_samples}, allowed: an integer >= 1", field="--min-samples")
    if not 0.0 <= public_fraction < 1.0:
        raise UserInputError(f"is {public_fraction}, allowed: 0 <= fraction < 1", field="--public-fraction")
    if seed < 0 or public_seed < 0:
        raise UserInputError("seeds must be integers >= 0", field="--seed")
    split = _parse_split(split_text)
    if dataset != "digits" and data_root is None:
        from rafl.data.sources import EXPECTED, default_data_root

        if not default_data_root().exists():
            raise UserInputError(f"is required for {dataset} (or set $RAFL_DATA_ROOT; {default_data_root()} "
                                 f"does not exist); expected there: {EXPECTED[dataset]}", field="--data-root")
    if scheme == "natural" and dataset != "femnist":
        raise UserInputError(f"natural needs writer ids; allowed with --dataset femnist, not {dataset}",
                             field="--partition")
    _check_out(out)

    # ---- load and partition (raise UserInputError on bad data; nothing is written yet)
    from rafl.data import load_dataset, make_partition
    from rafl.data.report import plot_class_heatmap, print_partition_table

    try:
        ds = load_dataset(dataset, data_root, resolution=resolution, limit_per_class=limit_per_class,
                          progress=not quiet)
    except UserInputError as err:  # the library's argument name -> the option
        if err.field != "data_root":
            raise
        raise UserInputError(err.message, source=err.source, field="--data-root") from None
    labels = ds.labels.numpy()
    try:
        part = make_partition(labels, scheme, clients, seed, k=k, alpha=alpha, min_samples=min_samples,
                              public_fraction=public_fraction, public_seed=public_seed, writers=ds.writers,
                              split=split, dataset=dataset, origin=ds.origin)
    except UserInputError as err:  # the library names its arguments (k, min_samples): say the options
        if err.source is not None or err.field not in PARTITION_OPTIONS:
            raise
        raise UserInputError(err.message, field=PARTITION_OPTIONS[err.field]) from None
    if limit_per_class is not None:
        part.meta["limit_per_class"] = limit_per_class
    counts = part.class_counts(labels, ds.num_classes)
    print_partition_table(part, labels, ds.classes)

    # ---- write atomically: everything lands under OUT at once, or nothing does
    from rafl.io import atomic_dir

    params = ", ".join(f"{k_}={v}" for k_, v in part.meta.get("params", {}).items())
    title = f"{dataset}: {part.meta.get('scheme')}{f' ({params})' if params else ''}, {part.n_clients} clients"
    with atomic_dir(out, overwrite=True) as tmp:
        part.save(tmp / "partition.json")
        plot_class_heatmap(counts, ds.classes, tmp / "class_heatmap.png", title=title)
    click.echo(f"wrote {out / 'partition.json'} and {out / 'class_heatmap.png'}")
