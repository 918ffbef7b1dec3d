"""``rafl flower-app``: write the Flower App that runs rafl's federation on a SuperLink."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("flower-app")
@click.option("--out", "folder", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="folder to write the app's pyproject.toml into (created; must not hold one)")
@click.option("--config", "config", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="rafl run config (YAML) the app runs by default (`flwr run --run-config` overrides it)")
@click.option("--runs", "runs", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"),
              show_default=True, help="folder the ServerApp creates run dirs in")
def flower_app(folder: Path, config: Path | None, runs: Path) -> None:
    """Write a Flower App for `flwr run`: its ServerApp runs rafl's engine (sampling, checkpoints,
    metrics) on the SuperLink's machine and its ClientApp runs each client's step on the SuperNode
    that hosts it (node config partition-id=I num-partitions=P hosts clients I, I+P, ...).
    """
    from rafl.federation.run_config import load_run_config
    from rafl.federation.flower import write_app

    # the run config is read on the SuperLink only when `flwr run` starts it, and `flwr run`
    # exits 0 whatever happens there: check what can be checked here (schema, algorithm and its
    # hyperparameters, model names; not the data, the supernet or plug-in modules, which live on the
    # SuperLink's and the nodes' machines)
    from rafl.errors import UserInputError
    from rafl.models import resolve_models

    models = load_run_config(config).clients.models
    try:
        resolve_models(models)
    except UserInputError as err:
        raise UserInputError(err.message, source=config, field=err.field) from None
    path = write_app(folder, config=config, out=runs)
    click.echo(f"wrote {path}")
    click.echo(f"run it: flwr run {folder} <superlink connection> --stream")
