"""``rafl compare``: several FL methods on one partition with one seed -> one table and one plot."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from pathlib import Path

import click

from rafl.cli import exit_interrupted
from rafl.cli._types import data_root_option
from rafl.cli.federate import FAILED_ROUNDS_EXIT
from rafl.federation.catalog import DEFAULT_ALGORITHMS, method_catalog


class _MethodsOption(click.Option):
    """``--algorithms``, whose help lists every registered method
    (:func:`rafl.federation.catalog.method_catalog`, read from the algorithms' source) when the help
    is shown, not whenever the command runs."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = f"Comma-separated registered methods: {', '.join(method_catalog())}."
        return super().get_help_record(ctx)


@click.command("compare")
@click.option("--algorithms", cls=_MethodsOption, default=",".join(DEFAULT_ALGORITHMS), show_default=True)
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="Run config YAML (the `rafl federate` format; its algorithm section holds shared "
                   "hyperparameters and per-method sub-sections, e.g. algorithm: {fedtgp: {server_epochs: 50}}).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config field, e.g. --set engine.rounds=5 --set algorithm.fedgh.server_lr=0.05.")
@data_root_option("Short for --set data.root=PATH.")
@click.option("--models", default="htfe-tiny", show_default=True,
              help="nas (resource-aware subnets of the supernet), a model group (htfe4, htfe8, htfe-tiny), "
                   "or a comma list of model names / package.module:factory plug-ins (round-robin). "
                   "Default: the config's clients.models if it sets one, else htfe-tiny (nas when heterofl "
                   "or fedrolex is compared: their client models must be width-slices of one model).")
@click.option("--feature-dim", type=click.IntRange(min=1, max=4096), default=128, show_default=True,
              help="Common representation width D of model-group clients (default: the config's "
                   "clients.feature_dim if it sets one).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder (new or empty): compare.md/.csv/.json, compare.png, one run dir per method.")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path), default=None,
              help="Continue an interrupted comparison in this folder with its own config.yaml: finished "
                   "methods are kept, an interrupted one continues from its last complete round.")
@click.option("--tune", "tune", multiple=True, metavar="KEY=V1,V2,...",
              help="Tune before comparing: every method's KEY (lr: each method that has it; fedgh.server_lr: one "
                   "method's) from this grid, scored on the clients' validation splits (never test) with the same "
                   "number of trials per method; trials in OUT/tune/, picks in OUT/tune.json. Repeat for a product "
                   "grid. Interrupted: run the same command again.")
@click.option("--no-finetune", is_flag=True,
              help="No fine-tuned rows (<method>-ft: a global-model method's final model fine-tuned locally for "
                   "its local_epochs on every client, then scored). Recorded in OUT/config.yaml: --resume keeps it.")
@click.option("--quiet", "--no-progress", "quiet", is_flag=True, help="No progress bars.")
def compare(algorithms: str, config_path: Path | None, overrides: tuple[str, ...], data_root: Path | None, models: str,
            feature_dim: int, out: Path | None, resume_dir: Path | None, tune: tuple[str, ...], no_finetune: bool,
            quiet: bool) -> None:
    """Run several FL methods on the same data partition, client models and seed, and write a
    comparison table (mean/std client accuracy, MB communicated, wall time) and a plot."""
    from rafl.errors import UserInputError
    from rafl.folders import Comparison

    if resume_dir is None:  # the checks that need no torch first: a typo answers at once
        if out is None:
            raise UserInputError("is required (the output folder), or --resume a previous one", field="--out")
        Comparison.check_new(out)  # new or empty (or holding only its --tune trials), and writable
        _precheck_config(config_path, (f"data.root={data_root}", *overrides) if data_root is not None else overrides,
                         algorithms, data_root is not None)
    from rafl.models import resolve_models
    from rafl.stages.compare import (
        default_models,
        load_compare_config,
        load_compare_resume,
        parse_grid,
        recorded_finetune,
        run_compare,
        run_tuning,
    )

    if resume_dir is not None:
        ctx = click.get_current_context()
        flags = {"algorithms": "--algorithms", "config_path": "--config", "overrides": "--set",
                 "data_root": "--data-root", "models": "--models",
                 "feature_dim": "--feature-dim", "out": "--out", "tune": "--tune"}
        given = [flag for param, flag in flags.items() if _given(ctx, param)]
        if given:
            raise UserInputError(f"cannot be combined with {', '.join(given)} (the folder's config.yaml is used)",
                                 field="--resume")
        cfg, hparams, models, feature_dim = load_compare_resume(resume_dir)
        finetune = recorded_finetune(resume_dir) and not no_finetune  # as started, unless --no-finetune now
        with _say_how_to_resume(resume_dir):
            rows = run_compare(cfg, hparams, resume_dir, models=models, feature_dim=feature_dim,
                               progress=not quiet, resume=True, finetune=finetune)
        out = resume_dir
    else:
        names = [a.strip().lower() for a in algorithms.split(",") if a.strip()]
        if not names:
            raise UserInputError("is empty; give comma-separated method names", field="--algorithms")
        if len(set(names)) != len(names):
            raise UserInputError(f"lists a method twice ({algorithms})", field="--algorithms")
        ctx = click.get_current_context()
        if _given(ctx, "models"):
            with _models_option():
                resolve_models(models)  # a bad --models before the config is read
        if data_root is not None:  # a --set data.root given too comes after it and wins
            overrides = (f"data.root={data_root}", *overrides)
        cfg, hparams = load_compare_config(config_path, overrides, names,
                                           models if _given(ctx, "models") else None)
        # clients.models / clients.feature_dim set in the config (or --set) count unless the option is given
        from_config = not _given(ctx, "models") and "models" in cfg.clients.model_fields_set
        if from_config:
            models = cfg.clients.models
            resolve_models(models)
        elif not _given(ctx, "models"):
            models, note = default_models(names)
            if note is not None:  # the methods' defaults (lr, the server's pool) follow the models
                cfg, hparams = load_compare_config(config_path, overrides, names, models)
                click.echo(note, err=True)
        if not _given(ctx, "feature_dim") and "feature_dim" in cfg.clients.model_fields_set:
            feature_dim = cfg.clients.feature_dim
        _warn_ignored(cfg, models)
        trials = parse_grid(tune, hparams) if tune else None
        with _say_how_to_resume(out), (contextlib.nullcontext() if from_config else _models_option()):
            if trials:
                hparams = run_tuning(cfg, hparams, trials, out, models=models, feature_dim=feature_dim,
                                     progress=not quiet)
            rows = run_compare(cfg, hparams, out, models=models, feature_dim=feature_dim, progress=not quiet,
                               finetune=not no_finetune)
    click.echo((out / "compare.md").read_text().rstrip())
    click.echo(f"wrote {out / 'compare.md'}, {out / 'compare.csv'}, {out / 'compare.png'} ({len(rows)} method{'s' if len(rows) != 1 else ''})")
    failed = [r for r in rows if r.get("failed_rounds")]
    if failed:  # as rafl federate: a comparison with failed rounds is not a clean result
        for r in failed:
            why = (r.get("failed_round_reasons") or ["no reason recorded"])[0]
            click.echo(f"error: {r['algorithm']}: {r['failed_rounds']} of {r['rounds']} round(s) failed; {why}",
                       err=True)
        raise click.exceptions.Exit(FAILED_ROUNDS_EXIT)


def _precheck_config(config_path: Path | None, overrides: tuple[str, ...], algorithms: str,
                     data_root_given: bool) -> None:
    """What can be checked without torch: the run config's file, ``--set`` keys and values outside
    ``algorithm`` (whose per-method sections :func:`rafl.stages.compare.load_compare_config`
    reads), the fields that contradict each other, the names in ``--algorithms``
    (:func:`rafl.federation.catalog.check_method`), ``engine.backend`` (in-process) and the data
    root (:func:`rafl.stages.checks.check_data`).

    Raises:
        UserInputError: what :func:`rafl.config.read_run_config` raises, except for ``algorithm``;
            an unknown method (field ``--algorithms``); another backend; a missing data root.
    """
    from rafl.config import read_run_config
    from rafl.errors import UserInputError
    from rafl.federation.catalog import check_method
    from rafl.stages.checks import check_data

    try:
        cfg, _ = read_run_config(config_path, overrides)
    except UserInputError as err:
        if not (err.field or "").startswith("algorithm"):
            raise
        cfg = None
    for name in (a for a in algorithms.split(",") if a.strip()):
        check_method(name, field="--algorithms")
    if cfg is None:
        return
    if cfg.engine.backend != "in-process":
        raise UserInputError(f"is {cfg.engine.backend!r}; rafl compare runs its methods in-process (allowed: "
                             "in-process); run one method on Flower with rafl federate", field="engine.backend")
    check_data(cfg, "--data-root" if data_root_given else "data.root")


@contextlib.contextmanager
def _models_option() -> Iterator[None]:
    """The client models came from ``--models`` (or its default): an error about them names the
    option, not the config key ``clients.models`` the library reports."""
    from rafl.errors import UserInputError

    try:
        yield
    except UserInputError as err:
        if err.field != "clients.models":
            raise
        raise UserInputError(err.message, source=err.source, field="--models") from None


def _given(ctx: click.Context, param: str) -> bool:
    """Whether option ``param`` was given on the command line (not its default)."""
    src = ctx.get_parameter_source(param)
    return src is not None and src.name == "COMMANDLINE"


@contextlib.contextmanager
def _say_how_to_resume(out: Path) -> Iterator[None]:
    """After Ctrl-C / SIGTERM: one stderr line with what the folder keeps and the command that
    continues the comparison; when no method completed a round (the folder is gone then), that
    nothing was kept."""
    try:
        yield
    except (KeyboardInterrupt, click.exceptions.Abort, SystemExit) as err:
        if (out / "config.yaml").is_file():
            click.echo(f"interrupted: finished methods and complete rounds are kept in {out}; continue with: "
                       f"rafl compare --resume {shlex.quote(str(out))}", err=True)
        elif (out / "tune").is_dir():
            click.echo(f"interrupted while tuning: finished trials are kept in {out / 'tune'}; run the same command "
                       "again to continue", err=True)
        else:
            click.echo("interrupted before any method completed a round: nothing was kept", err=True)
        raise exit_interrupted(err) from None


def _warn_ignored(cfg, models: str) -> None:
    """Warn about settings that are valid but do nothing in this comparison (``algorithm.name``:
    :func:`rafl.stages.compare.load_compare_config`)."""
    from rafl.errors import warn

    # (--feature-dim with nas: rafl.stages.prepare warns about clients.feature_dim, which it sets)
    if models.strip() != "nas" and (cfg.clients.arch or cfg.clients.archs):
        warn("clients.arch / clients.archs pick supernet subnets and apply to --models nas only; ignored here")
