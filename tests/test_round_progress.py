"""Progress inside a round: the engine's events (clients done / sampled, local epochs) and their display."""

from __future__ import annotations

import io

import pytest
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.federation.events import listening, report
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
    first = [(e, i) for e, i in events[:events.index(("round_end", {"round": 1})) + 1] if e != "batch"]
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
    first = events[:events.index(("round_end", {"round": 1})) + 1]
    names = [e for e, _ in first if e != "batch"]
    # the workers' clients reported by the run as their replies come (no per-epoch events from them)
    assert names == ["round", "client_done", "client_done", "trained", "evaluate", "round_end"], names
    # ... and their batches, forwarded with the client each worker trains
    done = {i["client"] for e, i in first if e == "client_done"}
    batches = [i for e, i in first if e == "batch"]
    assert batches and {i["client"] for i in batches} == done and all(i["epochs"] == 2 for i in batches)
    lines = log.read_text().splitlines()
    estimates = [line for line in lines if line.startswith("rounds: about ")]  # once, from round 1's batches
    assert len(estimates) == 1 and "round 1's first batches" in estimates[0], lines
    lines = [line for line in lines if line not in estimates]
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


def _batches(display, now, client, times, batches, epochs=1, worker=False):
    for b, t in enumerate(times, start=1):
        now[0] = float(t)
        info = {"batch": b, "batches": batches, "epoch": 1, "epochs": epochs}
        display("batch", {**info, "client": client} if worker else info)


def test_batches_give_a_count_and_the_time_left_in_the_round():
    now = [0.0]
    out = io.StringIO()
    display = RoundProgress(out, interval_s=1000, terminal=False, clock=lambda: now[0])
    display("round", {"round": 3, "rounds": 10, "clients": 2})
    display("client", {"client": 7})
    display("epoch", {"epoch": 1, "epochs": 1})
    _batches(display, now, 7, [0, 1, 2, 3], batches=4)
    # 3 batches in 3 s; client 7 has none left, the other client's 4 (the mean seen) are to come
    assert display.seconds_left() == pytest.approx(4.0)
    assert display.status() == "0/2 clients done, client 7 in local epoch 1/1, batch 4/4, about 4 s left in the round"
    assert out.getvalue() == ""  # no estimate before ESTIMATE_AFTER_S seconds of batches or a finished client


def test_the_first_round_says_what_the_rounds_should_take_and_how_to_shorten_them():
    now = [0.0]
    out = io.StringIO()
    display = RoundProgress(out, interval_s=1000, terminal=False, clock=lambda: now[0])
    display("round", {"round": 3, "rounds": 10, "clients": 2})
    display("client", {"client": 7})
    _batches(display, now, 7, [0, 1, 2, 3, 4, 5], batches=10)
    # at 5 s: 1 batch/s, 4 + 10 batches left: 14 s left, 19 s per round, 8 rounds to run
    assert out.getvalue().splitlines() == [
        "rounds: about 19 s of local training per round (from round 3's first batches), so about 2.5 min for the 8 "
        "rounds to run, plus evaluation; shorter: --set engine.rounds=N, --set algorithm.local_epochs=1, or fewer "
        "clients per round (--set engine.clients_per_round=0.5)"]
    _batches(display, now, 7, [6, 7, 8], batches=10)
    display("round", {"round": 4, "rounds": 10, "clients": 2})
    _batches(display, now, 7, [9, 20, 30], batches=10)
    assert len(out.getvalue().splitlines()) == 1  # once


def test_clients_training_in_workers_are_shown_side_by_side():
    now = [0.0]
    display = RoundProgress(io.StringIO(), interval_s=1000, terminal=False, clock=lambda: now[0])
    display("round", {"round": 1, "rounds": 1, "clients": 3})
    _batches(display, now, 4, [0, 1], batches=8, epochs=2, worker=True)
    _batches(display, now, 9, [2], batches=5, epochs=2, worker=True)
    # 2 batches in 2 s: client 4 has 14 left, client 9 has 9, the third client the mean (16 + 10) / 2
    assert display.status() == ("0/3 clients done, client 4 epoch 1/2 batch 2/8, client 9 epoch 1/2 batch 1/5, "
                                "about 36 s left in the round")
    display("client_done", {"client": 4})
    assert display.status().startswith("1/3 clients done, client 9 epoch 1/2 batch 1/5, about ")
