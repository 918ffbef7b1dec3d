"""``rafl federate``: run a federation (default: RaFL on digits with searched subnets per device)."""

from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path

import click

from rafl.cli import exit_interrupted
from rafl.errors import UserInputError, shown, warn


#: the accuracies a method reports besides its deployed model's (``model.acc``), in table order:
#: metric prefix -> (column label, what it measures), named as in every table and plot
#: (:data:`rafl.reports.tables.ACCURACY_NAMES`); the same rules as ``rafl compare``'s table
EXTRA_ACCURACIES = {
    "knowledge": ("acc knowledge network", "knowledge network accuracy"),                  # RaFL
    "proto": ("acc nearest prototype", "nearest-prototype accuracy"),                     # FedTGP, FedProto
    "prior": ("acc +prior", "global header + local label prior accuracy"),                # FedGH
    "local": ("acc local header", "locally fine-tuned header accuracy"),                  # FedGH
    "global": ("acc shared model", "shared model accuracy"),                              # FML, FedKD
}


def print_table(summary: dict, run_dir: Path) -> None:
    """The per-client table (profile, subnet MACs/params, test images, the deployed model's accuracy
    with its binomial standard error, and every other accuracy the method reports, e.g. FedTGP's
    nearest-prototype accuracy) with means, and the run dir."""
    from rich.console import Console
    from rich.table import Table

    from rafl.reports.tables import binomial_se, fmt_bytes

    rows = summary["table"]
    group = any("model" in r for r in rows)  # clients.models: a model group (no profiles, no subnets)
    extra = [k for k in EXTRA_ACCURACIES if any(r.get(f"{k}.acc") is not None for r in rows)]
    t = Table(title=f"{summary['algorithm']}: final round {summary['rounds']}, accuracy on each client's own test split")
    for col in ("client", "model", "params (M)", "train", "test") if group else \
            ("client", "profile", "MACs (M)", "params (M)", "train", "test"):
        t.add_column(col, justify="left" if col in ("profile", "model") else "right")
    t.add_column("acc deployed model", justify="right")
    t.add_column("± se", justify="right")
    for k in extra:
        t.add_column(EXTRA_ACCURACIES[k][0], justify="right")

    def f(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    var_sum, n_acc = 0.0, 0
    for r in rows:
        who = [r["model"]] if group else [r["profile"], f(r["macs_m"])]
        acc = r.get("model.acc")
        se = None if acc is None else binomial_se(acc, int(r["n_test"]))
        if se is not None:
            var_sum, n_acc = var_sum + se ** 2, n_acc + 1
        t.add_row(str(r["client"]), *who, f(r["params_m"], 3), str(r["n_train"]), str(r["n_test"]),
                  f(acc, 3), f(se, 3), *(f(r.get(f"{k}.acc"), 3) for k in extra))
    m = summary["means"]
    mean_se = (var_sum ** 0.5) / n_acc if n_acc else None  # of the mean over clients (independent clients)
    t.add_row("mean", *([""] if group else ["", f(m.get("macs_m"))]), f(m.get("params_m"), 3), "",
              str(sum(int(r["n_test"]) for r in rows)), f(m.get("model.acc"), 3), f(mean_se, 3),
              *(f(m.get(f"{k}.acc"), 3) for k in extra), style="bold")
    con = Console(width=max(120, Console().width))  # every column header on one line
    con.print(t)
    fin = summary["final"]
    tests = [int(r["n_test"]) for r in rows if r.get("model.acc") is not None]
    if tests:
        con.print(f"se = sqrt(p (1 - p) / test), the binomial standard error of an accuracy p over a client's "
                  f"test images ({min(tests)}..{max(tests)} here; one image moves it by 1/test, and 1.000 on 4 "
                  "images is 4 of 4, se 0); the mean's se is over all clients")
    for prefix, label in (("model", "deployed model accuracy"), *((k, EXTRA_ACCURACIES[k][1]) for k in extra)):
        if f"{prefix}.acc_sample_weighted" in fin:
            con.print(f"{label}: mean over clients {fin[f'{prefix}.acc_mean_over_clients']:.3f}, "
                      f"sample-weighted {fin[f'{prefix}.acc_sample_weighted']:.3f}, std over clients "
                      f"{fin[f'{prefix}.acc_std_over_clients']:.3f}")
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
    con.print(f"run dir: {run_dir}", soft_wrap=True)


def _hold(fd: int) -> int:
    """Keep the run dir's lock (:func:`rafl.io.lock_dir`) until the command ends; returns ``fd``."""
    import os

    click.get_current_context().call_on_close(lambda: os.close(fd))
    return fd




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


@click.command("federate", epilog=(
    "Config keys and their allowed values: rafl federate --show-config (add --config/--set to see the resolved "
    "run). Methods (algorithm.name) and their hyperparameters: rafl federate --list-algorithms. Ready-made run "
    "configs: examples/*.yaml in the repository (CIFAR-10 with NAS subnets or HtFE models, FEMNIST natural, a "
    "Flower deployment); the README's 'rafl federate' section explains every key."))
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="Run config YAML (dataset, partition, clients and profiles, algorithm, engine...); "
                   "missing keys take the defaults.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one config key (dotted, value parsed as YAML), e.g. --set engine.rounds=3. Repeatable.")
@click.option("--data-root", type=click.Path(path_type=Path), default=None,
              help="Where the dataset is (a tarball or an unpacked tree; `rafl data`): short for --set data.root=PATH.")
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
    from rafl.config import RunConfig, parse_overrides
    from rafl.federation.run_config import load_run_config
    from rafl.federation import pipeline
    from rafl.federation.checks import check_checkpoint_readable, check_resumable_here
    from rafl.io import check_output_dir, lock_dir

    if data_root is not None:
        if resume_dir is not None:
            raise UserInputError("cannot be combined with --resume (the run dir's config.yaml names its data)",
                                 field="--data-root")
        overrides = (f"data.root={data_root}", *overrides)  # a --set data.root given too comes after it and wins
    if show_config:
        from rafl.config import commented_config

        if resume_dir is not None:
            raise UserInputError("cannot be combined with --resume (the run dir's config.yaml is the run's config)",
                                 field="--show-config")
        click.echo(commented_config(load_run_config(config_path, overrides)), nl=False)
        return
    if resume_dir is not None:
        source = click.get_current_context().get_parameter_source("out")
        if source is not None and source.name == "COMMANDLINE":
            raise UserInputError("cannot be combined with --resume (the run continues in its own dir)",
                                 field="--out")
        if config_path is not None:
            raise UserInputError("cannot be combined with --resume (the run dir's config.yaml is used)",
                                 field="--config")
        cfg_file = resume_dir / "config.yaml"
        if _is_compare_folder(cfg_file):
            raise UserInputError("is a rafl compare folder, not a rafl federate run dir; continue it with: rafl "
                                 f"compare --resume {shlex.quote(str(resume_dir))}", source=resume_dir, field="--resume")
        if cfg_file.is_file() and not (resume_dir / "checkpoint.safetensors").is_file():
            raise UserInputError("never completed a round (no checkpoint.safetensors), so there is nothing to "
                                 "resume: run the command again under the same name (the folder is reused)",
                                 source=resume_dir, field="--resume")
        if not cfg_file.is_file():
            raise UserInputError("does not exist" if not resume_dir.exists() else
                                 "is not a rafl federate run dir (no config.yaml)", source=resume_dir,
                                 field="--resume")
        check_resumable_here(resume_dir)  # a SuperLink's run: its client states are on the nodes
        check_checkpoint_readable(resume_dir)  # cut short by a copy: say how to recover, before any work
        fixed = sorted({key for key, _ in parse_overrides(overrides) if key.split(".")[0] != "engine"})
        if fixed:  # before the values are read: e.g. another algorithm.name would fail on the run's hparams
            raise UserInputError(f"--resume may change only engine settings (engine.rounds to extend the run, "
                                 f"engine.backend, ...), not {fixed}", field="--set")
        # paths in a run dir's config.yaml are absolute (rafl.config.absolute_paths); in an older
        # one a relative path meant the current folder
        old = load_run_config(cfg_file, base=Path.cwd())
        try:
            cfg = load_run_config(cfg_file, overrides, base=Path.cwd())
        except UserInputError as err:  # the file alone is valid, so a --set value is at fault
            raise UserInputError(err.message, source="--set", field=err.field) from None
        changed = {k for k in ("data", "partition", "clients", "supernet", "search", "algorithm", "train", "seed")
                   if getattr(cfg, k) != getattr(old, k)}
        if changed:
            raise UserInputError(f"--resume may change only engine settings, not {sorted(changed)}", field="--set")
        pipeline.check_resume_rounds(resume_dir, cfg.engine.rounds, "engine.rounds")
        _hold(lock_dir(resume_dir, "--resume"))  # until the command ends: one run writes here at a time
        prep = pipeline.prepare(cfg, progress=progress)
        try:
            summary = pipeline.run(prep, resume_dir, resume=True, progress=progress)
        except (KeyboardInterrupt, click.exceptions.Abort, SystemExit) as err:
            if _say_how_to_resume(resume_dir):
                raise exit_interrupted(err) from None
            raise
        from rafl.io import atomic_write_yaml

        atomic_write_yaml(resume_dir / "config.yaml", cfg.resolved())
        print_table(summary, resume_dir)
        return

    cfg: RunConfig = load_run_config(config_path, overrides)
    check_output_dir(out)  # a file, or a folder nothing can be created in: before any work
    name = cfg.name or f"{cfg.algorithm.name}-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    if Path(name).name != name or name in (".", ".."):
        raise UserInputError(f"is {shown(name)}; allowed: a plain folder name (no '/' or '..'), created under --out",
                             field="name")
    run_dir = out / name
    out_existed = out.exists()
    lock: int | None = None
    if cfg.name is None:  # a default name: runs started in the same second (a sweep) get -2, -3, ...
        # claimed with an atomic mkdir, so parallel runs never share (or clean up) one run dir
        stem, i = name, 1
        while True:
            try:
                run_dir.mkdir(parents=True)
                break
            except FileExistsError:
                i += 1
                name = f"{stem}-{i}"
                run_dir = out / name
    elif run_dir.exists():
        if not (run_dir / "config.yaml").is_file() and any(run_dir.iterdir()):
            raise UserInputError("already exists and is not a rafl federate run dir (choose another name or --out)",
                                 source=run_dir)
        if (run_dir / "checkpoint.safetensors").is_file():
            raise UserInputError("already exists (choose another name or --out, or --resume it)", source=run_dir)
        # never completed a round: a run killed (kill -9) before its first checkpoint, whose lock the
        # kernel released; a live run holds it, and lock_dir refuses then
        lock = _hold(lock_dir(run_dir, "name"))
        for p in list(run_dir.iterdir()):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        warn(f"{run_dir} never completed a round (its run was killed before the first checkpoint): starting it "
             "afresh")
    else:
        try:
            run_dir.mkdir(parents=True)
        except FileExistsError:  # another run took this name a moment ago
            raise UserInputError("already exists: another run took this name (choose another name or --out)",
                                 source=run_dir) from None
    if lock is None:
        lock = _hold(lock_dir(run_dir, "name"))  # until the command ends (the kernel releases it on kill -9)
    try:
        prep = pipeline.prepare(cfg, progress=progress)  # every check happens here; the run dir is still empty
        summary = pipeline.run(prep, run_dir, progress=progress)
    except BaseException as err:
        if run_dir.exists() and not (run_dir / "checkpoint.safetensors").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # ours, with no complete round: leave nothing half-made
        if not out_existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if isinstance(err, (KeyboardInterrupt, click.exceptions.Abort, SystemExit)):
            if not _say_how_to_resume(run_dir):
                click.echo("interrupted before the first complete round: nothing was kept", err=True)
            raise exit_interrupted(err) from None
        raise
    print_table(summary, run_dir)


def _is_compare_folder(cfg_file: Path) -> bool:
    """Whether ``cfg_file`` is the config.yaml ``rafl compare`` writes (:func:`rafl.config.is_compare_record`)."""
    import yaml

    from rafl.config import is_compare_record
    from rafl.io import load_yaml, read_text_file

    try:
        return is_compare_record(load_yaml(read_text_file(cfg_file), cfg_file))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, UserInputError):
        return False  # not readable as a compare config: the checks below say what it is


def _say_how_to_resume(run_dir: Path) -> bool:
    """After Ctrl-C / SIGTERM: one stderr line with the rounds the checkpoint holds and the command
    that continues the run; ``False`` (nothing said) when no round completed: the run dir is gone then."""
    from rafl.federation.pipeline import completed_rounds

    if not (run_dir / "checkpoint.safetensors").is_file():
        return False
    done = completed_rounds(run_dir)
    click.echo(f"interrupted: {done} complete round(s) checkpointed in {run_dir}; continue with: "
               f"rafl federate --resume {shlex.quote(str(run_dir))}", err=True)
    return True
