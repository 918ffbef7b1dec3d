"""Progress inside a round: the engine's events (clients done / sampled, local epochs) and their display."""

from __future__ import annotations

import io

import pytest
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.federation.progress import listening, report
from rafl.reports.progress import RoundProgress


def _tiny_run_config(tmp_path, supernet_dir, space, rounds=2):
    cfg = {
        "name": "tiny",
        "data": {"limit_per_class": 10},
        "partition": {"alpha": 1.0, "min_samples": 5},
        "clients": {"n": 3, "profiles": ["pi4", "phone"], "arch": space.smallest().to_string()},
        "supernet": {"path": str(supernet_dir)},
        "algorithm": {"name": "standalone", "local_epochs": 2},
        "engine": {"rounds": rounds, "clients_per_round": 2, "target_accuracy": None, "workers": 1},
        "train": {"batch_size": 16},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_a_round_reports_each_client_and_its_local_epochs(tmp_path, tiny_supernet):
    supernet_dir, space = tiny_supernet
    events = []
    with listening(lambda event, info: events.append((event, dict(info)))):
        res = CliRunner().invoke(cli, ["federate", "--no-progress", "--config",
                                       str(_tiny_run_config(tmp_path, supernet_dir, space)), "--out",
                                       str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    rounds = [i for e, i in events if e == "round"]
    assert rounds == [{"round": 1, "rounds": 2, "clients": 2}, {"round": 2, "rounds": 2, "clients": 2}]
    first = events[:events.index(("round_end", {"round": 1})) + 1]
    names = [e for e, _ in first]
    # per sampled client: start, its two local epochs, done; then the runner's count, evaluation, the end
    assert names == ["round", "client", "epoch", "epoch", "client_done", "client", "epoch", "epoch", "client_done",
                     "trained", "evaluate", "round_end"], names
    assert [i for e, i in first if e == "epoch"] == [{"epoch": 1, "epochs": 2}, {"epoch": 2, "epochs": 2}] * 2
    assert first[names.index("trained")][1] == {"done": 2}
    assert first[names.index("evaluate")][1] == {"clients": 3}  # engine.eval_clients: all


@pytest.mark.slow
def test_with_worker_processes_only_the_run_shows_progress_and_counts_their_clients(tmp_path, tiny_supernet):
    supernet_dir, space = tiny_supernet
    events = []
    log = tmp_path / "progress.log"
    with open(log, "w") as stream:  # a real file: what a forked worker would write lands here too
        display = RoundProgress(stream, interval_s=0.0, terminal=False)
        with listening(display), listening(lambda event, info: events.append((event, dict(info)))):
            res = CliRunner().invoke(cli, ["federate", "--no-progress", "--config",
                                           str(_tiny_run_config(tmp_path, supernet_dir, space, rounds=3)),
                                           "--set", "engine.workers=2", "--out", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    names = [e for e, _ in events[:events.index(("round_end", {"round": 1})) + 1]]
    # the workers' clients reported by the run as their replies come (no per-epoch events from them)
    assert names == ["round", "client_done", "client_done", "trained", "evaluate", "round_end"], names
    lines = log.read_text().splitlines()
    shown = [(int(line.split("/")[0].split()[1]), int(line.split(": ")[1].split("/")[0])) for line in lines]
    assert shown and [r for r, _ in shown] == sorted(r for r, _ in shown)  # never a stale round's state
    assert all(done <= 2 for _, done in shown) and {r for r, _ in shown} == {1, 2, 3}


def _feed(display, events):
    for event, info in events:
        display(event, info)


ROUND = [("round", {"round": 3, "rounds": 10, "clients": 2}), ("client", {"client": 7}),
         ("epoch", {"epoch": 1, "epochs": 2}), ("epoch", {"epoch": 2, "epochs": 2}),
         ("client_done", {"client": 7}), ("client", {"client": 4}), ("epoch", {"epoch": 1, "epochs": 2})]


def test_off_a_terminal_a_line_is_written_at_most_once_per_interval():
    now = [0.0]
    out = io.StringIO()  # not a terminal: no bar, plain lines
    display = RoundProgress(out, interval_s=30, clock=lambda: now[0])
    assert not display.terminal
    for (event, info), t in zip(ROUND, [0, 10, 20, 40, 50, 75, 80]):
        now[0] = float(t)
        display(event, info)
    # lines at 40 s (first event >= 30 s after the round started) and at 75 s (>= 30 s after it)
    assert out.getvalue().splitlines() == [
        "round 3/10: 0/2 clients done, client 7 in local epoch 2/2 (40 s into the round)",
        "round 3/10: 1/2 clients done, client 4 (75 s into the round)",
    ]


def test_a_short_round_off_a_terminal_prints_nothing():
    out = io.StringIO()
    display = RoundProgress(out, interval_s=30, clock=lambda: 0.0)
    _feed(display, [*ROUND, ("client_done", {"client": 4}), ("trained", {"done": 2}),
                    ("evaluate", {"clients": 10}), ("round_end", {"round": 3})])
    assert out.getvalue() == ""
    assert display.status() == "2/2 clients done, evaluating 10 clients"


def test_on_a_terminal_a_bar_counts_clients_and_shows_the_epoch():
    out = io.StringIO()
    display = RoundProgress(out, terminal=True)
    _feed(display, ROUND)
    assert display.bar is not None and display.bar.n == 1 and display.bar.total == 2
    assert display.bar.postfix == "client 4 in local epoch 1/2"
    # a runner whose clients trained elsewhere (Flower) reports them all at once
    display("trained", {"done": 2})
    assert display.bar.n == 2
    display("round_end", {"round": 3})
    assert display.bar is None  # the bar is gone with the round


def test_report_without_a_listener_does_nothing_and_listeners_are_removed():
    seen = []
    report("round", round=1, rounds=1, clients=1)  # no listener: no effect, no error
    with listening(lambda e, i: seen.append(e)):
        report("epoch", epoch=1, epochs=1)
    report("epoch", epoch=2, epochs=2)
    assert seen == ["epoch"]
