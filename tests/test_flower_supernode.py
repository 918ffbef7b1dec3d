"""`rafl flower-supernode`: Flower's SuperNode with a shorter idle poll. The whole path on a real
SuperLink is every LocalFleet test of tests/test_flower.py (LocalFleet starts each SuperNode with
this command by default); these tests pin what it changes in Flower's loop and what it refuses."""

from __future__ import annotations

import importlib
import sys
import time

import flwr.supernode.start_client_internal as flower_loop
import pytest
from click.testing import CliRunner

from rafl.cli import cli
from rafl.errors import UserInputError
from rafl.stages.flower import fleet as flower_fleet
from rafl.stages.flower import supernode

# the module (flwr.supernode.cli re-exports the function under the module's name)
flower_cli = importlib.import_module("flwr.supernode.cli.flower_supernode")


@pytest.fixture
def restore_loop(monkeypatch):
    """Flower's loop module as it was after the test (patch_poll replaces its `time`)."""
    monkeypatch.setattr(flower_loop, "time", flower_loop.time)
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_flowers_supernode_loop_sleeps_through_its_module_time():
    """The name patch_poll replaces is the one flwr 1.42's loop sleeps through (3 s idle, 0.5 s for
    a reply): if another flwr moves it, this fails rather than the poll silently going back to 3 s."""
    import inspect

    source = inspect.getsource(flower_loop)
    assert flower_loop.time is time
    assert "time.sleep(3)" in source and "time.sleep(0.5)" in source


def test_the_patched_loop_sleeps_at_most_the_poll_interval(restore_loop, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    loop = supernode.patch_poll(0.05)
    assert loop is flower_loop and isinstance(flower_loop.time, supernode.PollClock)
    flower_loop.time.sleep(3)
    flower_loop.time.sleep(0.5)
    flower_loop.time.sleep(0.01)
    assert slept == [0.05, 0.05, 0.01]
    assert flower_loop.time.monotonic is time.monotonic  # everything else is time's own


def test_run_hands_flowers_own_command_its_arguments_with_the_poll_patched(restore_loop, monkeypatch):
    seen: dict = {}

    def fake_flower_supernode() -> None:
        seen["argv"] = list(sys.argv)
        seen["interval"] = flower_loop.time.poll_interval_s

    monkeypatch.setattr(flower_cli, "flower_supernode", fake_flower_supernode)
    res = CliRunner().invoke(cli, ["flower-supernode", "--poll-interval", "0.25", "--insecure", "--superlink",
                                   "127.0.0.1:9092", "--node-config", "partition-id=0 num-partitions=2"])
    assert res.exit_code == 0, res.output
    assert seen == {"argv": ["flower-supernode", "--insecure", "--superlink", "127.0.0.1:9092", "--node-config",
                             "partition-id=0 num-partitions=2"], "interval": 0.25}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "0.001"])
def test_a_bad_poll_interval_is_one_line_and_exit_2(restore_loop, value):
    res = CliRunner().invoke(cli, ["flower-supernode", "--poll-interval", value, "--insecure"])
    assert res.exit_code == 2
    assert "--poll-interval" in res.output and ">= 0.01" in res.output
    assert flower_loop.time is time  # refused before anything was patched


def test_local_fleet_checks_its_poll_interval_before_starting_anything(tmp_path):
    with pytest.raises(UserInputError, match="--poll-interval"):
        flower_fleet.LocalFleet(1, tmp_path / "fleet", poll_interval_s=0)
    assert not (tmp_path / "fleet").exists()



def test_run_hands_flower_the_default_signal_handlers(restore_loop, monkeypatch):
    """Flower's SuperNode puts back the handler it found when it stops: under the rafl CLI that was
    a SIGTERM handler raising SystemExit, which a second SIGTERM ran inside Flower's shutdown (the
    process then waited on its Runtime API thread). `run` gives Flower the defaults, as under its
    own `flower-supernode`."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    seen: dict = {}

    def fake_flower_supernode() -> None:
        seen["term"] = signal.getsignal(signal.SIGTERM)
        seen["int"] = signal.getsignal(signal.SIGINT)

    monkeypatch.setattr(flower_cli, "flower_supernode", fake_flower_supernode)
    try:
        signal.signal(signal.SIGTERM, lambda *args: None)  # what a CLI might have installed
        supernode.run(["--insecure"], poll_interval_s=0.2)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert seen == {"term": signal.SIG_DFL, "int": signal.default_int_handler}
