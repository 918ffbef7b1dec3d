"""rafl's forking SuperExec (`rafl flower-superexec`): the fork, the report of a new run to the
warm process, and the node-side cache it fills. The whole path on a real SuperLink with two
SuperNodes is tests/test_flower.py::test_deployment_on_a_superlink_with_two_supernodes (LocalFleet
runs every SuperNode with this SuperExec by default)."""

from __future__ import annotations

import os
import time

import pytest
from click.testing import CliRunner

from rafl.cli import cli
from rafl.stages.flower import node as flower_node
from rafl.stages.flower import superexec as flower_superexec


def _reap_all(executor: flower_superexec.ForkExecutor, limit_s: float = 120.0) -> None:
    """reconcile() until every child is reaped (a deadline only against a hang, not a measurement)."""
    deadline = time.monotonic() + limit_s
    while executor.children:
        executor.reconcile()
        assert time.monotonic() < deadline, "a forked child did not exit"
        time.sleep(0.01)


def test_reports_round_trip_through_a_pipe_and_a_partial_one_waits():
    read_end, write_end = os.pipe()
    report = flower_superexec._reporter(write_end)
    report("engine: {rounds: 2}\n")
    report("é" * 3)
    os.close(write_end)
    buffer = bytearray()
    flower_superexec.ForkExecutor._read(read_end, buffer)
    os.close(read_end)
    whole = bytes(buffer)
    partial = bytearray(whole[:-2])
    assert flower_superexec._take_messages(partial) == ["engine: {rounds: 2}\n"]  # the second is not whole yet
    partial += whole[-2:]
    assert flower_superexec._take_messages(partial) == ["é" * 3] and partial == bytearray()


class _Spec:
    runtime_api_address = "127.0.0.1:1"
    token = "ab" * 16
    insecure = True
    root_certificates_path = None
    runtime_dependency_install = False


def test_a_forked_child_runs_flowers_clientapp_function_and_its_new_run_is_warmed_in_the_parent(monkeypatch):
    """launch() forks a child that calls Flower's run_clientapp with the task's token; a run config
    the child meets for the first time reaches the parent's warm() once, after the child exited or
    before; the child's exit status is Flower's."""
    import flwr.supernode.runtime.run_clientapp as flwr_run_clientapp

    def fake_run_clientapp(*, runtime_api_address, token, insecure, certificates, parent_pid,
                           runtime_dependency_install):
        assert (runtime_api_address, token, insecure, certificates, parent_pid) == \
            ("127.0.0.1:1", "ab" * 16, True, None, None)
        flower_node.on_new_run("run config A")  # as _node_federation does for a config it has not built
        raise SystemExit(0)  # flwr_exit ends every run_clientapp so

    monkeypatch.setattr(flwr_run_clientapp, "run_clientapp", fake_run_clientapp)
    warmed: list[str] = []
    executor = flower_superexec.ForkExecutor(warm=warmed.append)
    result = executor.launch(_Spec())
    assert result.status == "accepted" and len(executor.children) == 1
    _reap_all(executor)
    assert warmed == ["run config A"] and executor.pending == {}
    assert flower_node.on_new_run is None  # set in the child only


def test_a_run_that_fails_to_build_in_the_parent_stays_cold_and_the_loop_goes_on(monkeypatch, capsys):
    import flwr.supernode.runtime.run_clientapp as flwr_run_clientapp

    def fake_run_clientapp(**_):
        flower_node.on_new_run("bad")
        raise SystemExit(0)

    def warm(text):
        raise ValueError(f"cannot build {text}")

    monkeypatch.setattr(flwr_run_clientapp, "run_clientapp", fake_run_clientapp)
    executor = flower_superexec.ForkExecutor(warm=warm)
    executor.launch(_Spec())
    _reap_all(executor)
    assert "could not build a reported run here" in capsys.readouterr().err


def test_a_node_reports_a_run_config_once_before_building_it_and_warm_fills_the_cache(monkeypatch):
    """_node_federation reports a config it has no federation for (after the trust check), then
    builds it; warm() builds into the same cache, so a child forked after it reports nothing."""
    built: list[str] = []
    monkeypatch.setattr(flower_node, "_PREPARED", {})
    monkeypatch.setattr(flower_node, "_build", lambda text, cfg: (
        built.append(text), flower_node._PREPARED.setdefault(flower_node.config_key(text),
                                                             ("fed", cfg.seed)))[1])
    reported: list[str] = []
    monkeypatch.setattr(flower_node, "on_new_run", reported.append)
    trust = flower_node.NodeTrust.of({})
    text = "seed: 3\n"
    assert flower_node._node_federation(text, trust) == ("fed", 3)
    assert flower_node._node_federation(text, trust) == ("fed", 3)
    assert reported == [text] and built == [text, text]  # the second call is a cache hit inside _build
    flower_node.warm("seed: 4\n")
    flower_node._node_federation("seed: 4\n", trust)
    assert reported == [text]  # warmed before: nothing to report
    flower_node.warm("seed: 5\ntrain: {threads: 2}\n")  # would start torch's thread pool here: left cold
    assert built[-1] == "seed: 4\n"


def test_a_refused_run_config_is_not_reported(monkeypatch, tmp_path):
    reported: list[str] = []
    monkeypatch.setattr(flower_node, "on_new_run", reported.append)
    outside = tmp_path / "elsewhere"
    with pytest.raises(flower_node.Refused):
        flower_node._node_federation(f"data: {{root: {outside}}}\n", flower_node.NodeTrust.of({}))
    assert reported == []


def test_a_warm_query_reports_an_accepted_run_config_once_and_nothing_else(monkeypatch, tmp_path):
    """The warm query (rafl.federation.flower_runner.warm_nodes): a SuperExec's child reports a run
    config the node accepts and answers warming; a refused config, a built one, a run with
    several torch threads or a ClientApp no SuperExec forked (on_new_run unset) report nothing."""
    reported: list[str] = []
    monkeypatch.setattr(flower_node, "_PREPARED", {})
    monkeypatch.setattr(flower_node, "on_new_run", reported.append)
    assert flower_node._warm("seed: 3\n", {}) == {"warming": True}
    assert reported == ["seed: 3\n"]
    outside = tmp_path / "elsewhere"
    assert flower_node._warm(f"data: {{root: {outside}}}\n", {}) == {"warming": False}  # outside the data roots
    assert flower_node._warm("seed: [\n", {}) == {"warming": False}  # not a run config
    assert flower_node._warm("seed: 5\ntrain: {threads: 2}\n", {}) == {"warming": False}
    flower_node._PREPARED[flower_node.config_key("seed: 4\n")] = ("fed", 4)
    assert flower_node._warm("seed: 4\n", {}) == {"warming": False}
    assert reported == ["seed: 3\n"]
    monkeypatch.setattr(flower_node, "on_new_run", None)
    assert flower_node._warm("seed: 6\n", {}) == {"warming": False}


def test_the_command_needs_tls_or_insecure():
    res = CliRunner().invoke(cli, ["flower-superexec", "--runtime-api-address", "127.0.0.1:9094"])
    assert res.exit_code == 2 and "--root-certificates" in res.output and "--insecure" in res.output
