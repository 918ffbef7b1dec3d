"""What a newcomer meets first: every option a message names exists on the command it names, one
``--data-root`` with one meaning on every command that reads a dataset, and bad input answered
before torch loads."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from rafl.cli import COMMANDS
from rafl.cli._types import DATA_ROOT_HELP

ROOT = Path(__file__).resolve().parents[1]

#: options of other programs that rafl's messages tell the user to pass there (Flower's `flwr`,
#: `flower-supernode` and SuperLink, torchrun, pip), and click's own --help
FOREIGN = {"--help", "--run-config", "--node-config", "--isolation", "--stream", "--host", "--port", "--ssl-",
           "--index-url", "--superlink", "--run-id", "--format", "--disable-runtime-dependency-installation", "--nproc",
           "--insecure", "--root-certificates"}

#: the commands that read a dataset
DATASET_COMMANDS = ("data", "supernet train", "search", "federate", "compare")

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands() -> dict[str, tuple[str, click.Command]]:
    """``rafl`` command path (``supernet train``) -> (its module, the click command)."""
    out = {}
    for name, target in COMMANDS.items():
        module, attr = target.split(":")
        cmd = getattr(importlib.import_module(module), attr)
        if isinstance(cmd, click.Group):
            out.update({f"{name} {sub}": (module, c) for sub, c in cmd.commands.items()})
        else:
            out[name] = (module, cmd)
    return out


def _options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def _messages(tree: ast.AST):
    """Every string literal (an f-string with ``{}`` for its fields) that is not a docstring."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and id(node) not in parts):
            yield node.lineno, node.value


def test_every_option_a_message_names_exists_on_its_command():
    """A message (error, warning, help) that names ``--opt`` names an option of the command it is
    about: ``rafl CMD ... --opt`` in the text, else the commands of its own ``rafl.cli`` module (or
    of the command whose stage module it is), else (library code) one of rafl's commands."""
    cmds = _commands()
    opts = {path: _options(c) for path, (_, c) in cmds.items()}
    every = set().union(*opts.values())
    names = sorted(cmds, key=len, reverse=True)  # `supernet train` before `supernet`
    missing = []
    checked = 0
    for file in sorted((ROOT / "rafl").rglob("*.py")):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts)
        # a command's stage and its checks (rafl.stages.profile and rafl.stages.profile_checks for
        # rafl.cli.profile, ...) speak for that command
        cli = {f"rafl.stages.{n}{part}": f"rafl.cli.{n}" for n in ("profile", "supernet", "data")
               for part in ("", "_checks")}.get(module, module)
        own = set().union(*(opts[p] for p, (m, _) in cmds.items() if m == cli))
        for line, text in _messages(ast.parse(file.read_text())):
            for m in OPTION.finditer(text):
                opt = m.group()
                if opt in FOREIGN:
                    continue
                before = text[:m.start()]
                # `rafl CMD ... --opt` as one command line (no quote, comma or bracket between them)
                named = [(before.rfind(f"rafl {n}"), n) for n in names if f"rafl {n}" in before]
                if named and re.search(r"[`;,()]", before[max(named)[0]:]):
                    named = []
                pool = opts[max(named)[1]] if named else (own or every)
                checked += 1
                if opt not in pool:
                    missing.append(f"{file.relative_to(ROOT)}:{line}: {opt} in {text[:90]!r}")
    assert checked > 100  # the walk saw the messages
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", DATASET_COMMANDS)
def test_every_command_that_reads_a_dataset_takes_data_root_with_one_meaning(path):
    cmd = _commands()[path][1]
    param = next((p for p in cmd.params if "--data-root" in p.opts), None)
    assert param is not None, f"rafl {path} has no --data-root"
    assert param.help.startswith(DATA_ROOT_HELP)


def test_search_reads_the_shipped_supernets_data_from_data_root(tmp_path):
    """The message for a missing CIFAR-10 names --data-root, and `rafl search` takes it."""
    from click.testing import CliRunner

    from rafl.cli import cli

    missing = tmp_path / "nowhere"
    res = CliRunner().invoke(cli, ["search", "--supernet", "cifar10", "--device-profile", "pi4",
                                   "--data-root", str(missing), "--out", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {missing}: --data-root: does not exist; expected "), res.output
    assert not (tmp_path / "o").exists()
    env = {"RAFL_DATA_ROOT": str(missing)}  # measuring again reads the data (the shipped measurements need none)
    res = CliRunner(env=env).invoke(cli, ["search", "--supernet", "cifar10", "--device-profile", "pi4", "--remeasure",
                                          "--out", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 2 and "--data-root" in res.output, res.output


#: bad input of every command, answered in one line before torch loads (bench/error_latency.py times them)
BAD_INPUT = [
    ["federate", "--config", "{tmp}/none.yaml"],
    ["federate", "--config", "{tmp}/bad.yaml"],
    ["federate", "--set", "engine.rounds=0"],
    ["federate", "--set", "engine.roundz=3"],
    ["federate", "--set", "clients.profiles=[pi5]"],
    ["federate", "--set", "clients.budgets.pi4.latency_ms=-1"],
    ["federate", "--data-root", "{tmp}", "--resume", "{tmp}"],
    ["compare", "--out", "{tmp}/c", "--set", "partition.alpha=0"],
    ["compare", "--out", "{tmp}/bad.yaml"],
    ["compare", "--algorithms", "rafl"],
    ["search", "--device-profile", "pi5"],
    ["search", "--device-profile", "{tmp}/bad.yaml"],
    ["search", "--device-profile", "pi4", "--supernet", "{tmp}/none"],
    ["search", "--device-profile", "pi4", "--supernet", "cifar10", "--data-root", "{tmp}/none"],
    ["search", "--device-profile", "pi4", "--supernet", "cifar10", "--remeasure"],  # (without it: no data read)
    ["data", "--dataset", "cifar11"],
    # issue 57: answered after torch loaded (6-19 s), or only after supernet training and the search
    ["federate", "--set", "algorithm.name=fedx"],
    ["federate", "--set", "algorithm.lrr=0.1"],
    ["federate", "--rounds", "3"],
    ["federate", "--resume", "{tmp}/none"],
    ["federate", "--resume", "{tmp}/run"],
    ["federate", "--set", "supernet.path=cifar10", "--set", "data.dataset=cifar10", "--data-root", "{tmp}/none"],
    ["federate", "--set", "supernet.path=cifar10", "--set", "data.dataset=cifar10", "--data-root", "{tmp}/bad.yaml"],
    ["federate", "--set", "engine.clients_per_round=20"],
    ["federate", "--set", "engine.min_valid_uploads=11"],
    ["federate", "--set", "partition.scheme=pathological"],
    ["federate", "--set", "partition.public_fraction=0"],
    ["federate", "--set", "data.dataset=cifar10"],
    # server BN statistics without a server pool (refused after the data and the federation were built)
    ["federate", "--set", "partition.public_fraction=0", "--set", "train.bn_statistics=server"],
    ["compare", "--out", "{tmp}/c", "--algorithms", "rafl,fedx"],
    ["compare", "--out", "{tmp}/c", "--set", "engine.backend=flower"],
    ["profile", "--device-profile", "pi4", "--arch", "r32_k9e9", "--out", "{tmp}/c"],
    ["supernet", "train", "--dataset", "cifar10", "--data-root", "{tmp}/none", "--out", "{tmp}/c"],
    # an output folder holding someone else's files (rafl compare answered it after torch loaded)
    ["compare", "--out", "{tmp}/run"],
    ["compare", "--out", "{tmp}/run", "--tune", "lr=0.01,0.1"],
    ["data", "--out", "{tmp}/run"],
    ["search", "--device-profile", "pi4", "--out", "{tmp}/run"],
    # --build-lut over an existing file that is not a LUT (answered after torch loaded)
    ["profile", "--build-lut", "--device-profile", "pi4", "--out", "{tmp}/bad.yaml"],
    ["profile", "--build-lut", "--device-profile", "pi4", "--out", "{tmp}/bad.yaml/lut.yaml"],  # parent: a file
]


@pytest.mark.parametrize("args", BAD_INPUT, ids=[" ".join(a[:3]) + (f" {a[-1]}" if len(a) > 3 else "")
                                                  for a in BAD_INPUT])
def test_bad_input_is_answered_before_torch_loads(tmp_path, args):
    """One error line, exit 2, and torch never imported (what makes the answer take seconds)."""
    (tmp_path / "bad.yaml").write_text("engine: [1\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("not a run dir\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = ("import sys, json\nfrom rafl.cli import main\ntry:\n    main(json.loads(sys.argv[1]))\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)\n")
    env = {**os.environ, "RAFL_CACHE_DIR": str(tmp_path / "cache"), "RAFL_DATA_ROOT": str(tmp_path / "no-data")}
    res = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert lines[-1] == "exit 2 False", res.stderr
    assert len(lines) == 2 and lines[0].startswith("error: "), res.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written: no run dir, no cache


@pytest.mark.slow
def test_compare_picks_sliceable_client_models_for_weight_sharing_methods(tmp_path, tiny_supernet):
    """`rafl compare --algorithms heterofl,fedrolex,uniform,rafl` with no --models runs every method on
    one supernet's subnets (htfe-tiny's models are not width-slices of one another) and says so."""
    from click.testing import CliRunner

    from rafl.cli import cli
    from rafl.stages.compare import DEFAULT_MODELS, default_models

    assert default_models(["rafl", "fedgh", "uniform"]) == (DEFAULT_MODELS, None)
    assert default_models(["rafl", "fedrolex"])[0] == "nas"
    path, space = tiny_supernet
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "heterofl,fedrolex,uniform,rafl", "--quiet",
                                   "--out", str(out), "--set", f"supernet.path={path}",
                                   "--set", "data.limit_per_class=10", "--set", "clients.n=3",
                                   "--set", "algorithm.local_epochs=1", "--set", "engine.rounds=1",
                                   "--set", f"clients.arch={space.smallest().to_string()}"])
    assert res.exit_code == 0, res.output
    assert "--models: nas (a searched subnet of the supernet per device profile, for every method): heterofl, " \
           "fedrolex average(s) width-slices of one model" in res.output
    table = json.loads((out / "compare.json").read_text())
    assert table["models"] == "nas"
    assert [r["algorithm"] for r in table["rows"] if "finetuned_from" not in r] == ["heterofl", "fedrolex", "uniform",
                                                                                     "rafl"]


def test_help_points_only_at_files_and_sections_that_exist():
    """Every docs/*.md, examples/*.yaml and README section a command's help names is there."""
    from rafl.cli import cli

    readme = (ROOT / "README.md").read_text()
    named = 0
    for path, (_, cmd) in _commands().items():
        with click.Context(cmd, info_name=f"rafl {path}", parent=click.Context(cli, info_name="rafl")) as ctx:
            text = " ".join(cmd.get_help(ctx).split())
        for ref in re.findall(r"(?:docs|examples)/[\w.*-]+\.(?:md|yaml)", text):
            named += 1
            assert list(ROOT.glob(ref)), f"rafl {path} --help names {ref}, which does not exist"
        for section in re.findall(r"README's '([^']+)' section", text):
            assert f"## {section}" in readme, f"rafl {path} --help names README section {section!r}"
    assert named >= 2


def test_federate_table_explains_its_empty_cells(capsys):
    """A client with no figure is `-` in the table, and one line under it says why and what the
    means are over."""
    from rafl.cli.federate import print_table

    rows = [{"client": i, "profile": "pi4", "macs_m": 3.0, "params_m": 0.4, "arch": "r24_k3e3", "n_train": 90,
             "n_test": 10, "model.acc": acc} for i, acc in enumerate([0.5, None, 0.7, None])]
    summary = {"table": rows, "algorithm": "rafl", "rounds": 1, "means": {"model.acc": 0.6, "macs_m": 3.0,
                                                                          "params_m": 0.4},
               "final": {}, "cum_mb": 1.0, "cum_bytes_up": 5e5, "cum_bytes_down": 5e5,
               "mean_bytes_up_per_client_per_round": 2.5e5, "co_mb_to_target": None, "target_accuracy": None,
               "failures": 0}
    print_table(summary, Path("runs/x"))
    out = " ".join(capsys.readouterr().out.split())
    assert ("-: no figure for client(s) 1, 3 (2 of 4): they have not trained in any round yet (a round trains "
            "engine.clients_per_round of the clients), so they hold no model of their own; the means are over the "
            "2 clients with a figure") in out


def test_supernet_info_prints_whole_arch_strings_on_a_narrow_terminal():
    from click.testing import CliRunner

    from rafl.cli import cli

    res = CliRunner(env={"COLUMNS": "70"}).invoke(cli, ["supernet", "info", "cifar10"])
    assert res.exit_code == 0, res.output
    meta = json.loads((ROOT / "rafl" / "pretrained" / "cifar10" / "supernet.json").read_text())
    cells: dict[str, str] = {}
    which = None
    for line in res.output.splitlines():
        cols = [c.strip() for c in line.split("│")]
        if len(cols) == 5:  # │ subnet │ arch │ test acc │
            which = cols[1] or which
            cells[which] = cells.get(which, "") + cols[2]
    for name in ("smallest", "middle", "largest"):
        assert cells[name] == meta["metrics"]["archs"][name]


def test_every_plot_has_a_title(tmp_path, monkeypatch):
    from rafl.federation.round_record import ModelAccuracy, RoundEvaluation, RoundRecord
    from rafl.reports import compare, run

    titles = []
    real = run.save_figure

    def keep(fig, path, **kw):
        titles.append(fig.axes[0].get_title())
        return real(fig, path, **kw)

    monkeypatch.setattr(run, "save_figure", keep)
    history = [RoundRecord(round=r, sampled=2, failed=0, bytes_up=0, bytes_down=0, cum_bytes_up=0,
                           cum_bytes_down=500_000 * r,
                           evaluation=RoundEvaluation({"model": ModelAccuracy(0.1 * r, 0.1 * r, 0.01)}))
               for r in (1, 2)]
    run.RunReport(tmp_path).run_done(history, {"algorithm": "fedgh"})
    assert titles == [f"fedgh, {tmp_path.name}: client test accuracy by round",
                      f"fedgh, {tmp_path.name}: client test accuracy vs communication"]
    import matplotlib.pyplot as plt

    seen = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: seen.append(
        fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()))
    rows = [record.as_row() for record in history]
    compare.plot_accuracy_vs_mb(tmp_path / "c.png", {"rafl": rows, "fedgh": rows})
    compare.plot_compare(tmp_path / "p.png", [{"algorithm": "rafl", "model.acc_mean": 0.5, "model.acc_std": 0.1,
                                               "mb_total": 1.0, "mb_up": 0.5, "mb_down": 0.5, "wall_s": 3.0}])
    assert seen == ["rafl, fedgh: client test accuracy vs communication",
                    "rafl compare, 1 method on one partition: final round"]


def _run_until(cmd, ready: Path, sig, env=None):
    """Start ``cmd``, wait until ``ready`` exists (a completed round's file: the trigger is the run's own
    progress, not a sleep), send ``sig``, return ``(exit status, stderr)``."""
    import signal
    import time

    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not ready.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.integration
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_federate_with_workers_stops_on_a_signal_keeping_complete_rounds(tmp_path, tiny_supernet, sig):
    import signal

    signum = getattr(signal, sig)
    path, _ = tiny_supernet
    out = tmp_path / "runs"
    code, err = _run_until(
        [sys.executable, "-m", "rafl", "federate", "--no-progress", "--out", str(out), "--set", "name=w",
         "--set", f"supernet.path={path}", "--set", "data.limit_per_class=10", "--set", "clients.n=4",
         "--set", "engine.rounds=500", "--set", "engine.workers=2", "--set", "algorithm.name=standalone",
         "--set", "algorithm.local_epochs=1"],
        out / "w" / "checkpoint.safetensors", signum)
    assert code == 128 + signum, err
    done = len((out / "w" / "metrics.jsonl").read_text().splitlines())
    assert err.rstrip().endswith(f"interrupted: {done} complete round(s) checkpointed in {out / 'w'}; continue "
                                 f"with: rafl federate --resume {out / 'w'}"), err
    assert not [p for p in (out / "w").rglob("*") if ".tmp" in p.name]  # nothing half-written


@pytest.mark.integration
def test_compare_with_workers_stops_on_sigterm_and_says_how_to_resume(tmp_path, tiny_supernet):
    import signal

    path, space = tiny_supernet
    out = tmp_path / "cmp"
    code, err = _run_until(
        [sys.executable, "-m", "rafl", "compare", "--quiet", "--algorithms", "standalone,rafl", "--models", "nas",
         "--out", str(out), "--set", f"supernet.path={path}", "--set", "data.limit_per_class=10",
         "--set", "clients.n=4", "--set", "engine.rounds=500", "--set", "engine.workers=2",
         "--set", "algorithm.local_epochs=1", "--set", f"clients.arch={space.smallest().to_string()}"],
        out / "standalone" / "checkpoint.safetensors", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert err.rstrip().endswith(f"interrupted: finished methods and complete rounds are kept in {out}; continue "
                                 f"with: rafl compare --resume {out}"), err
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_the_commands_that_take_a_shipped_supernet_name_every_one():
    """`rafl search --supernet`, `rafl profile --supernet` and `rafl supernet info` list every shipped
    supernet's name (the cross-device examples use cifar10-proxy5k)."""
    from rafl.cli import cli
    from rafl.supernet.pretrained import PRETRAINED

    for path in ("search", "profile", "supernet info"):
        cmd = _commands()[path][1]
        with click.Context(cmd, info_name=f"rafl {path}", parent=click.Context(cli, info_name="rafl")) as ctx:
            text = " ".join(cmd.get_help(ctx).split())
        assert all(name in text for name in PRETRAINED), (path, text)
