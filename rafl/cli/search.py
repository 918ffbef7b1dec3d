"""``rafl search``: find the most accurate subnet that meets every budget of each device profile."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.cli._types import FiniteFloatRange, data_root_option
from rafl.errors import UserInputError


def _check_data(supernet_dir: Path, data_root: Path | None) -> None:
    """The supernet's dataset can be found (``--data-root``, else the root its training config
    recorded, else the default), checked before torch loads; its contents are checked when read."""
    from rafl.data.sources import check_data_root
    from rafl.io import read_json_file

    meta = supernet_dir / "supernet.json"
    try:
        cfg = (read_json_file(meta) or {}).get("config") or {} if meta.is_file() else {}
    except (OSError, ValueError, AttributeError, UserInputError):
        return  # loading the supernet reports it
    data_cfg = cfg.get("data", cfg) if isinstance(cfg.get("data"), dict) else cfg
    name = data_cfg.get("dataset", "digits")
    if name == "digits" or not isinstance(name, str):
        return
    try:
        check_data_root(name, data_root if data_root is not None else data_cfg.get("data_root", data_cfg.get("root")))
    except UserInputError as err:
        raise UserInputError(err.message, source=err.source, field="--data-root") from None
    except KeyError:
        return  # an unknown dataset: loading the supernet's data reports it


@click.command("search")
@click.option("--device-profile", "profiles", multiple=True, required=True,
              help="Shipped profile name (pi4, jetson-nano, ...; or its file name pi4.yaml, from any folder) or a YAML "
                   "path; repeat for several.")
@click.option("--supernet", "supernet_dir", type=click.Path(path_type=Path), default=None,
              help="Supernet folder from `rafl supernet train`, or a shipped one by name: cifar10 or cifar10-proxy5k "
                   "[default: the quickstart supernet on digits, trained once and cached].")
@data_root_option("The dataset the supernet was trained on: its server validation split scores the subnets "
                  "(replaces the data root recorded in the supernet's training config).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/search"), show_default=True,
              help="Output folder; one subfolder per profile (replaced atomically; other profiles' "
                   "folders from earlier searches are kept and listed in OUT/search.json).")
@click.option("--generations", type=click.IntRange(min=0), default=500, show_default=True,
              help="Evolution generations (OFA: 500).")
@click.option("--population", type=click.IntRange(min=2), default=100, show_default=True,
              help="Population size (OFA: 100).")
@click.option("--time-budget", "time_budget_s", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="Stop each profile's evolution after this many seconds.")
@click.option("--estimator", type=click.Choice(["predictor", "measured"]), default="predictor",
              show_default=True, help="Accuracy during the evolution: an MLP predictor trained on "
                                      "measured subnets, or measuring every subnet (slow).")
@click.option("--predictor-samples", type=click.IntRange(min=4), default=None,
              help="Subnets measured (on the server-val split, cached per supernet) to train the predictor "
                   "(OFA: thousands; >= 500 for a predictor that ranks) [default: the subnets measured beside "
                   "the supernet (cifar10: shipped), else 500]. Fewer measure faster.")
@click.option("--top-k", type=click.IntRange(min=1), default=5, show_default=True,
              help="Final candidates re-measured per profile; the best measured one that meets the "
                   "profile's budgets wins (any profile's finalists, when several are searched).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed (the search is deterministic).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes measuring subnets (one torch thread each; the same accuracies for any count) "
                   "[default: the CPU cores this process may use].")
@click.option("--remeasure", is_flag=True,
              help="Measure the predictor's subnets on the supernet's server-val split even when measurements "
                   "ship beside its weights (cifar10 ships 515: without this option it reads no data).")
@click.option("--quiet", "--no-progress", "quiet", is_flag=True, help="No progress bars.")
def search(profiles: tuple[str, ...], supernet_dir: Path | None, data_root: Path | None, out: Path, generations: int,
           population: int, time_budget_s: float | None, estimator: str, predictor_samples: int | None, top_k: int,
           seed: int, workers: int | None, remeasure: bool, quiet: bool) -> None:
    """Search, per device profile, the supernet's subnet with the best estimated accuracy that
    meets every budget of the profile (OFA's evolutionary search with several constraints).

    Writes OUT/<profile>/: subnet.yaml, subnet.safetensors (BN recalibrated), subnet.onnx
    (checked), cost.json (+ the cost model's report), history.jsonl, pareto.json/.png,
    result.json; and OUT/search.json, the index of every profile folder in OUT (a later search
    into the same OUT replaces its own profiles' folders and keeps the others). Each profile gets
    the best measured finalist of any profile searched in the same command that meets its
    budgets ("found for X" when another profile's search found it). Prints one line per profile.
    """
    from rafl.search.profile import load_profile

    # every check below runs before torch loads (a typo answers at once)
    try:
        profs = [load_profile(p) for p in profiles]  # unknown / malformed profiles: exit 2 before any work
    except UserInputError as err:
        if err.source is not None:  # a profile file: its own field
            raise
        raise UserInputError(err.message, field="--device-profile") from None
    names = [p.name for p in profs]
    if len(set(names)) != len(names):
        raise UserInputError(f"profile names repeat: {', '.join(names)}", field="--device-profile")
    from rafl.stages.checks import SEARCH_OUTPUT

    SEARCH_OUTPUT.check(out)
    from rafl.supernet.pretrained import is_pretrained_name, pretrained_path

    if supernet_dir is not None and is_pretrained_name(str(supernet_dir)):
        supernet_dir = pretrained_path(str(supernet_dir))  # a shipped supernet, checksum-checked
    if supernet_dir is not None and not supernet_dir.exists():
        raise UserInputError("no such supernet folder (train one with `rafl supernet train`, or omit "
                             "--supernet to use the quickstart supernet)", source=supernet_dir, field="--supernet")
    from rafl.supernet.pretrained import MEASUREMENTS_NAME

    if supernet_dir is not None and (data_root is not None or remeasure
                                     or not (supernet_dir / MEASUREMENTS_NAME).is_file()):
        _check_data(supernet_dir, data_root)  # (measurements beside the supernet: no data is read)
    from rafl.search.evolution import SearchConfig
    from rafl.stages.search import run_search

    given = {} if predictor_samples is None else {"predictor_samples": predictor_samples}
    config = SearchConfig(population=population, generations=generations, time_budget_s=time_budget_s,
                          estimator=estimator, top_k=top_k, seed=seed, progress=not quiet, workers=workers,
                          **given)  # the options' click ranges are SearchConfig's constraints
    try:
        results = run_search(profs, out, config, supernet_dir=supernet_dir, data_root=data_root, remeasure=remeasure,
                             say=None if quiet else lambda line: click.echo(line, err=True))
    except UserInputError as err:  # the library's argument name -> the option
        if err.field != "data_root":
            raise
        raise UserInputError(err.message, source=err.source, field="--data-root") from None
    except (KeyboardInterrupt, SystemExit) as err:
        from rafl.cli import exit_interrupted
        from rafl.search.estimators import measurement_cache_dir

        click.echo(f"interrupted: rafl search stopped; no profile folder was half-written (finished ones are "
                   f"complete), and the subnets measured so far are kept in {measurement_cache_dir()}, so the "
                   "same command measures only the rest", err=True)
        raise exit_interrupted(err) from None
    from rafl.search.evolution import MEASURED_BEFORE, binding_text
    from rafl.search.predictor import tau_meaning
    from rafl.stages.search import same_subnet_note

    for name, res in results.items():
        if res.accuracy_source != "measured":
            click.echo(f"{name}: its pick was not measured (no data here): its accuracy is the predictor's; "
                       "measure it with --remeasure and the dataset", err=True)
    fit = next(iter(results.values())).predictor_fit
    if fit:
        click.echo(f"predictor: Kendall tau {fit['kendall_tau']:.3f}, RMSE {fit['rmse']:.4f} ({fit['folds']}-fold "
                   f"cross-validation over {fit['n_holdout']} measured subnets): {tau_meaning(fit['kendall_tau'])}")
    for name, res in results.items():
        c = res.cost
        where = ("" if res.found_for == name else ", known before the search" if res.found_for == MEASURED_BEFORE
                 else f", found for {res.found_for}")
        click.echo(f"{name}: {res.arch.to_string()}  acc {res.accuracy:.4f} ({res.accuracy_source}{where})  "
                   f"{c.macs_m:.2f} M MACs  {c.latency_ms:.3g} ms  peak {c.peak_memory_mb:.3g} MiB  "
                   f"binds: {binding_text(res.budget_use)}  -> {out / name}")
    for line in same_subnet_note(results):
        click.echo(line)
