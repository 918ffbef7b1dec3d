"""``rafl flower-app``: write the Flower App that runs rafl's federation on a SuperLink;
``rafl flower-superexec``: run a SuperNode's ClientApps from one warm process; ``rafl
flower-supernode``: Flower's SuperNode with a shorter idle poll."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.stages.flower.supernode import DEFAULT_POLL_INTERVAL_S


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
    # the run config is read on the SuperLink only when `flwr run` starts it, and `flwr run`
    # exits 0 whatever happens there: check what can be checked here (schema, algorithm and its
    # hyperparameters, model names; not the data, the supernet or plug-in modules, which live on the
    # SuperLink's and the nodes' machines)
    from rafl.errors import UserInputError
    from rafl.federation.run_config import load_run_config
    from rafl.models import resolve_models
    from rafl.stages.flower.app import write_app

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


@click.command("flower-supernode", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S, show_default=True,
              help="the longest wait, in seconds (>= 0.01), between the idle node's requests for a message and "
                   "between its checks for a ClientApp's reply (Flower's flower-supernode: 3 and 0.5); give it "
                   "before Flower's options")
@click.argument("supernode_args", nargs=-1, type=click.UNPROCESSED)
def flower_supernode(poll_interval: float, supernode_args: tuple[str, ...]) -> None:
    """Run Flower's SuperNode (`flower-supernode SUPERNODE_ARGS`: the same options, see
    `flower-supernode --help`) polling the SuperLink every --poll-interval seconds when idle instead
    of Flower's fixed 3 s: a deployment round waits up to one poll per message. Each idle node then
    sends 1/--poll-interval requests a second to the SuperLink. With `--isolation process`, start
    `rafl flower-superexec` beside it. Stops on Ctrl-C / SIGTERM as Flower's command does.
    """
    from rafl.stages.flower.supernode import run

    run(list(supernode_args), poll_interval_s=poll_interval)
