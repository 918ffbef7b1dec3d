"""``rafl federate``: run a federation (default: RaFL on digits with searched subnets per device)."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.cli import exit_interrupted
from rafl.cli._types import data_root_option
from rafl.errors import UserInputError


def print_table(summary: dict, run_dir: Path) -> None:
    """The per-client table (profile, subnet MACs/params, test images, the deployed model's accuracy
    with its binomial standard error, and every other accuracy the method reports, e.g. FedTGP's
    nearest-prototype accuracy) with means, and the run dir."""
    from rich.console import Console
    from rich.table import Table

    from rafl.federation.algorithms import DEPLOYED, get_algorithm
    from rafl.federation.metric_keys import MODEL, ModelKeys
    from rafl.reports.tables import binomial_se, fmt_bytes

    rows = summary["table"]
    group = any("model" in r for r in rows)  # clients.models: a model group (no profiles, no subnets)
    # the other accuracies the method reports (e.g. FedTGP's nearest prototype), in its order
    extra = [a for a in get_algorithm(summary["algorithm"]).accuracies
             if a != DEPLOYED and any(r.get(ModelKeys(a.prefix).acc) is not None for r in rows)]
    t = Table(title=f"{summary['algorithm']}: final round {summary['rounds']}, accuracy on each client's own test split")
    for col in ("client", "model", "params (M)", "train", "test") if group else \
            ("client", "profile", "MACs (M)", "params (M)", "train", "test"):
        t.add_column(col, justify="left" if col in ("profile", "model") else "right")
    t.add_column("acc deployed model", justify="right")
    t.add_column("± se", justify="right")
    for a in extra:
        t.add_column(f"acc {a.name}", justify="right")

    def f(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    var_sum, n_acc = 0.0, 0
    for r in rows:
        who = [r["model"]] if group else [r["profile"], f(r["macs_m"])]
        acc = r.get(MODEL.acc)
        se = None if acc is None else binomial_se(acc, int(r["n_test"]))
        if se is not None:
            var_sum, n_acc = var_sum + se ** 2, n_acc + 1
        t.add_row(str(r["client"]), *who, f(r["params_m"], 3), str(r["n_train"]), str(r["n_test"]),
                  f(acc, 3), f(se, 3), *(f(r.get(ModelKeys(a.prefix).acc), 3) for a in extra))
    m = summary["means"]
    mean_se = (var_sum ** 0.5) / n_acc if n_acc else None  # of the mean over clients (independent clients)
    t.add_row("mean", *([""] if group else ["", f(m.get("macs_m"))]), f(m.get("params_m"), 3), "",
              str(sum(int(r["n_test"]) for r in rows)), f(m.get(MODEL.acc), 3), f(mean_se, 3),
              *(f(m.get(ModelKeys(a.prefix).acc), 3) for a in extra), style="bold")
    con = Console(width=max(120, Console().width))  # every column header on one line
    con.print(t)
    fin = summary["final"]
    blank = [str(r["client"]) for r in rows if r.get(MODEL.acc) is None]
    if blank:
        con.print(f"-: no figure for client(s) {', '.join(blank)} ({len(blank)} of {len(rows)}): they have not trained "
                  "in any round yet (a round trains engine.clients_per_round of the clients), so they hold no model "
                  f"of their own; the means are over the {len(rows) - len(blank)} clients with a figure")
    tests = [int(r["n_test"]) for r in rows if r.get(MODEL.acc) is not None]
    if tests:
        con.print(f"se = sqrt(p (1 - p) / test), the binomial standard error of an accuracy p over a client's "
                  f"test images ({min(tests)}..{max(tests)} here; one image moves it by 1/test, and 1.000 on 4 "
                  "images is 4 of 4, se 0); the mean's se is over all clients")
    for keys, label in ((ModelKeys(a.prefix), a.meaning) for a in (DEPLOYED, *extra)):
        if keys.acc_sample_weighted in fin:
            con.print(f"{label}: mean over clients {fin[keys.acc_mean_over_clients]:.3f}, "
                      f"sample-weighted {fin[keys.acc_sample_weighted]:.3f}, std over clients "
                      f"{fin[keys.acc_std_over_clients]:.3f}")
    held = summary.get("new_clients")
    if held and MODEL.acc_mean in held:  # the new-clients protocol (clients.held_out_fraction)
        ft = f", after one local fine-tune {held[MODEL.acc_ft_mean]:.3f}" if MODEL.acc_ft_mean in held else ""
        con.print(f"new clients ({len(held['held_out'])} held out of training, each on its tier's final model): mean "
                  f"over them {held[MODEL.acc_mean]:.3f} as deployed{ft} (summary.json: new_clients)")
    co = summary.get("co_mb_to_target")
    # in the unit that shows each amount: prototype uploads of 440 bytes printed as 0.000 MB
    con.print(f"communication: {fmt_bytes(summary['cum_mb'] * 1e6)} total (up {fmt_bytes(summary['cum_bytes_up'])}, "
              f"down {fmt_bytes(summary['cum_bytes_down'])}); upload per client per round "
              f"{fmt_bytes(summary['mean_bytes_up_per_client_per_round'])}; "
              + (f"{fmt_bytes(co * 1e6)} to reach accuracy {summary['target_accuracy']}" if co is not None
                 else f"target accuracy {summary['target_accuracy']} not reached"
                 if summary["target_accuracy"] is not None else "no target accuracy set")
              + f"; failed clients: {summary['failures']}")
    if not group:
        con.print("subnets: " + ", ".join(sorted({f"{r['profile']}={r['arch']}" for r in rows})), soft_wrap=True)
    if summary.get("bn_statistics"):
        con.print(f"BN statistics of the deployed models: {summary['bn_statistics']} (train.bn_statistics)", soft_wrap=True)
    con.print(f"run dir: {run_dir}", soft_wrap=True)


#: the exit status of a run that completed with failed rounds (bad input is 2, an interrupt 130/143)
FAILED_ROUNDS_EXIT = 3


def exit_failed_rounds(summary: dict, run_dir: Path) -> None:
    """A run with failed rounds (``summary.json``'s ``failed_rounds``: rounds with fewer valid
    uploads than ``engine.min_valid_uploads``, which changed no state) ends with exit status
    :data:`FAILED_ROUNDS_EXIT` after one ``error:`` line per reason on stderr; its run dir is kept."""
    failed = int(summary.get("failed_rounds", 0) or 0)
    if not failed:
        return
    click.echo(f"error: {failed} of {summary['rounds']} round(s) failed (their uploads were refused; the "
               f"server state was not changed by them); see rejected_reasons in {Path(run_dir) / 'metrics.jsonl'}",
               err=True)
    for why in summary.get("failed_round_reasons", [])[:5]:
        click.echo(f"error: {why}", err=True)
    raise click.exceptions.Exit(FAILED_ROUNDS_EXIT)


def list_algorithms() -> str:
    """``rafl federate --list-algorithms``: every registered method (``algorithm.name``), its paper
    (the first sentence of its docstring), what it needs, and its hyperparameters with defaults."""
    import re

    from rafl.federation.algorithms import ALGORITHMS

    lines = []
    for name in sorted(ALGORITHMS):
        cls = ALGORITHMS[name]
        doc = " ".join((cls.__doc__ or "").replace("``", "").split())
        first = re.split(r"(?<=[.)])\s+(?=Client|Server|[A-Z][a-z]+ state)", doc, maxsplit=1)[0]
        needs = [w for w, on in (("identical client models", cls.requires_homogeneous),
                                 ("the server's public pool", cls.uses_public_pool)) if on]
        lines.append(f"{name}: {first}" + (f" Needs {' and '.join(needs)}." if needs else ""))
        hp = ", ".join(f"{k}={v}" for k, v in cls.defaults.items())
        lines.append(f"    hyperparameters (--set algorithm.KEY=VALUE): {hp}" if hp else "    no hyperparameters")
    return "\n".join(lines)


def _list_algorithms(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(list_algorithms())
        ctx.exit(0)


def _check_resume_options(config_path: Path | None, show_config: bool) -> None:
    """The options ``--resume`` cannot be combined with (the run dir's ``config.yaml`` is the run's
    config, and the run continues in its own dir).

    Raises:
        UserInputError: naming the option (``--show-config``, ``--out``, ``--config``).
    """
    if show_config:
        raise UserInputError("cannot be combined with --resume (the run dir's config.yaml is the run's config)",
                             field="--show-config")
    source = click.get_current_context().get_parameter_source("out")
    if source is not None and source.name == "COMMANDLINE":
        raise UserInputError("cannot be combined with --resume (the run continues in its own dir)", field="--out")
    if config_path is not None:
        raise UserInputError("cannot be combined with --resume (the run dir's config.yaml is used)", field="--config")


@click.command("federate", epilog=(
    "Config keys and their allowed values: rafl federate --show-config (add --config/--set to see the resolved "
    "run). Methods (algorithm.name) and their hyperparameters: rafl federate --list-algorithms. Ready-made run "
    "configs: examples/*.yaml in the repository (CIFAR-10 with NAS subnets or HtFE models, FEMNIST natural, a "
    "Flower deployment). Docs: docs/federate.md (the run, its files, the table) and docs/config.md (every key)."))
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="Run config YAML (dataset, partition, clients and profiles, algorithm, engine...); "
                   "missing keys take the defaults.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one config key (dotted, value parsed as YAML), e.g. --set engine.rounds=3. Repeatable.")
@data_root_option("Short for --set data.root=PATH.")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path), default=None,
              help="Continue RUN_DIR from its last complete round (same config; --set may extend engine.rounds).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs"), show_default=True,
              help="Parent folder of the run dir.")
@click.option("--progress/--no-progress", " /--quiet", default=True, show_default=True, help="Progress bars.")
@click.option("--show-config", is_flag=True,
              help="Print the resolved run config (defaults <- --config <- --set) as YAML, each key with its allowed "
                   "values, and exit without running.")
@click.option("--list-algorithms", is_flag=True, is_eager=True, expose_value=False, callback=_list_algorithms,
              help="List the methods (algorithm.name) with their hyperparameters and defaults, and exit.")
def federate(config_path: Path | None, overrides: tuple[str, ...], data_root: Path | None, resume_dir: Path | None,
             out: Path, progress: bool, show_config: bool) -> None:
    """Federate specialized subnets across simulated devices.

    With no options: digits, 10 clients (profiles pi4, jetson-nano, phone), Dirichlet alpha 0.5,
    the cached quickstart supernet (trained on the server's public pool on first use), one
    searched subnet per profile, RaFL. Prints a per-client table and the run dir, which holds
    config.yaml (resolved), clients.json, metrics.jsonl/csv, summary.json, plots and checkpoints.
    """
    if data_root is not None:
        if resume_dir is not None:
            raise UserInputError("cannot be combined with --resume (the run dir's config.yaml names its data)",
                                 field="--data-root")
        overrides = (f"data.root={data_root}", *overrides)  # a --set data.root given too comes after it and wins
    if resume_dir is None:
        from rafl.stages.checks import precheck_run

        # the file, --set, every key and value but the method's hyperparameters, the fields that contradict each
        # other, the method's name, the profiles and the data root: checked before torch and the models load (a
        # typo answers at once); the registry checks the hyperparameters' values below, on the config read here
        read = precheck_run(config_path, overrides, data_root_given=data_root is not None, data=not show_config)
    else:
        from rafl.stages.checks import check_resume_dir

        _check_resume_options(config_path, show_config)
        check_resume_dir(resume_dir)
    from rafl.federation.run_config import resolve_algorithm
    from rafl.stages import federate as stage

    if show_config:
        from rafl.config import commented_config

        click.echo(commented_config(resolve_algorithm(*read)), nl=False)
        return
    try:
        if resume_dir is not None:
            summary, run_dir = stage.resume(resume_dir, overrides, progress=progress)
        else:
            summary, run_dir = stage.start(resolve_algorithm(*read), out, progress=progress)
    except (KeyboardInterrupt, SystemExit) as err:  # the stage said what was kept and how to continue
        raise exit_interrupted(err) from None
    print_table(summary, run_dir)
    exit_failed_rounds(summary, run_dir)
