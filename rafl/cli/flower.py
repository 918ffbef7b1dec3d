"""``rafl flower-app``: write the Flower App that runs rafl's federation on a SuperLink;
``rafl flower-superexec``: run a SuperNode's ClientApps from one warm process."""

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
    from rafl.stages.flower.app import write_app

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


@click.command("flower-superexec")
@click.option("--runtime-api-address", required=True,
              help="the SuperNode's Runtime API, host:port (the SuperNode's --host/--port; it must run with "
                   "--isolation process)")
@click.option("--insecure", is_flag=True, help="no TLS to the Runtime API (a SuperNode on this machine)")
@click.option("--root-certificates", type=click.Path(dir_okay=False, exists=True), default=None,
              help="CA certificate (PEM) that signed the SuperNode's Runtime API certificate (its --ssl-* options)")
@click.option("--parent-pid", type=int, default=None, help="stop when this process exits")
@click.option("--superexec-auth-secret-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="the SuperNode's --superexec-auth-secret-file, if it sets one")
def flower_superexec(runtime_api_address: str, insecure: bool, root_certificates: str | None,
                     parent_pid: int | None, superexec_auth_secret_file: str | None) -> None:
    """Run the ClientApps of a SuperNode started with `--isolation process`, each forked from this
    one warm process (torch, flwr and rafl imported once; each run's data, subnets and search
    built once), instead of Flower's new `flwr-clientapp` process per message. Stops on Ctrl-C /
    SIGTERM. Linux and macOS (fork).
    """
    from rafl.errors import UserInputError
    from rafl.stages.flower.superexec import run

    if not insecure and root_certificates is None:
        raise UserInputError("give --root-certificates (TLS to the Runtime API) or --insecure (a SuperNode on "
                             "this machine)", field="--insecure")
    run(runtime_api_address, insecure=insecure, root_certificates=root_certificates, parent_pid=parent_pid,
        superexec_auth_secret_file=superexec_auth_secret_file)
