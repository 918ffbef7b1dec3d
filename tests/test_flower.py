"""The Flower backend: payload records, lost nodes, node discovery, and whole runs on Flower's
Simulation Runtime and on a real SuperLink with two SuperNodes (127.0.0.1 only), each compared
number for number with the in-process engine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import flwr.app as flwr_app  # rafl[test] installs rafl[flower]
import pytest
import torch
from click.testing import CliRunner

from rafl.cli import cli
from rafl.errors import UserInputError
from rafl.federation import flower_runner, flower_wire
from rafl.federation.payload import Payload
from rafl.stages.flower import app as flower_app
from rafl.stages.flower import fleet as flower_fleet
from rafl.stages.flower import node as flower_node

ARGS = ["--set", "data.limit_per_class=10", "--set", "clients.n=3", "--set", "engine.rounds=2",
        "--set", "algorithm.name=fedgh"]


@pytest.fixture(scope="module")
def supernet_dir(tiny_supernet):
    """The folder of conftest's tiny supernet (width 0.25, 16 px)."""
    return tiny_supernet[0]


@pytest.fixture(autouse=True)
def _frozen_node_clock(monkeypatch):
    """Nodes in this process (DirectGrid) answer while the server pushes, so no server timeout
    runs on them; their per-client deadline would only turn the machine's load into lost clients.
    Their clock stands still unless a test moves it."""
    monkeypatch.setattr(flower_node, "_clock", lambda: 0.0)


@pytest.fixture(autouse=True)
def _flower_home(tmp_path, tmp_path_factory, monkeypatch):
    """Every node of these tests (in this process or a SuperNode started here) keeps its client
    states under the test's folder and, as its operator's own setting, reads run inputs (the tiny
    supernet, profile files) from pytest's temporary folders."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("RAFL_FLOWER_STATE_DIR", str(tmp_path / "node-states"))
    monkeypatch.setenv("RAFL_FLOWER_DATA_ROOTS", str(tmp_path_factory.getbasetemp()))


def _federate(args):
    res = CliRunner().invoke(cli, ["federate", "--no-progress", *args])
    assert res.exit_code == 0, res.output
    return res


def _rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock columns and the bytes Flower's messages carried (the
    in-process runner sends none)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "wire_", "cum_wire_"))} for r in rows]


@pytest.fixture(scope="module")
def in_process(supernet_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("inproc")
    _federate(["--out", str(out), "--set", "name=ref", "--set", f"supernet.path={supernet_dir}", *ARGS])
    return out / "ref"


@pytest.fixture(scope="module")
def deployed(supernet_dir, tmp_path_factory):
    """The run of :func:`in_process` as the Flower App makes it on a SuperLink: :func:`flower_app.run_on_grid`
    without a shared disk, on two nodes in this process (:class:`DirectGrid`) that keep the client
    states on their own disk."""
    from flwr.supercore.task_identity import TaskIdentity

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    out = tmp_path_factory.mktemp("deployed")
    prep = federate.prepare(load_run_config(None, [f"supernet.path={supernet_dir}", *ARGS[1::2]]), progress=False)
    with pytest.MonkeyPatch.context() as mp:  # as the function-scoped fixtures _flower_home and task_identity do
        mp.setenv("RAFL_FLOWER_STATE_DIR", str(out / "node-states"))
        mp.setenv("RAFL_FLOWER_DATA_ROOTS", str(tmp_path_factory.getbasetemp()))
        mp.setattr(flower_node, "_clock", lambda: 0.0)  # as _frozen_node_clock
        for name in ("_run_id", "_node_id", "_task_id"):
            mp.setattr(TaskIdentity, name, int(name == "_run_id"))
        flower_app.run_on_grid(DirectGrid(2), prep, out / "run", progress=False)
    return out / "run"


# ---------------------------------------------------------------------- records
def test_payload_round_trips_through_flower_records():
    p = Payload({"w": torch.randn(3, 4), "ids": torch.arange(5), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 7)},
                {"n_samples": 12, "lr": 0.1, "class_ids": [0, 3, 9], "none_yet": [], "name": "fedgh", "ok": True})
    back = flower_wire.records_to_payload(flwr_app.RecordDict(flower_wire.payload_to_records(p)), "test")
    assert back.meta == p.meta and back.to_bytes() == p.to_bytes()
    for k, v in p.tensors.items():
        assert back.tensors[k].dtype == v.dtype and torch.equal(back.tensors[k], v)
    with pytest.raises(UserInputError, match="carries no rafl payload"):
        flower_wire.records_to_payload(flwr_app.RecordDict({}), "node 7")
    # one Flower array per payload (Flower moves each array as its own object), holding exactly
    # the counted bytes; an empty payload travels as an empty array
    (record,) = flower_wire.payload_to_records(p, ".4").values()
    assert list(record) == [flower_wire.BLOB] and record[flower_wire.BLOB].numpy().nbytes == p.nbytes()
    empty = flower_wire.records_to_payload(flwr_app.RecordDict(flower_wire.payload_to_records(Payload(), ".0")), "t", ".0")
    assert empty.is_empty()
    cut = flwr_app.RecordDict({"payload": flwr_app.ArrayRecord({flower_wire.BLOB: flwr_app.Array(
        record[flower_wire.BLOB].numpy()[:-9])})})
    with pytest.raises(UserInputError, match="node 7: corrupt or truncated payload"):
        flower_wire.records_to_payload(cut, "node 7")


# ---------------------------------------------------------------------- a fake grid
@pytest.fixture
def task_identity(monkeypatch):
    """Flower stamps messages with the run and node of the process (set by its runtimes)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


class FakeGrid:
    """A grid in this process: every pushed message gets ``answer(message)`` as its reply, an
    ``Exception`` as an error reply (as a SuperNode sends), None as no reply at all. Here
    ``answer`` is ``handler(message) -> RecordDict | Exception | None``."""

    def __init__(self, handler, nodes=(11, 22)):
        self.handler, self.nodes, self.out, self.n = handler, list(nodes), {}, 0

    def get_node_ids(self):
        return list(self.nodes)

    def answer(self, m):
        return self.handler(m)

    def push_messages(self, messages):
        ids = []
        for m in messages:  # ids in message order, as a grid returns them
            self.n += 1
            m.metadata.__dict__["_message_id"] = f"m{self.n}"  # as the SuperLink does (linkstate/utils.py)
            ans = self.answer(m)
            if isinstance(ans, Exception):
                ans = flwr_app.Message(flwr_app.Error(code=0, reason=str(ans)), reply_to=m)
            elif isinstance(ans, flwr_app.RecordDict):
                ans = flwr_app.Message(ans, reply_to=m)
            if ans is not None:
                self.out[m.metadata.message_id] = ans
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.out.pop(i) for i in list(ids) if i in self.out]


def test_exchange_counts_an_error_reply_and_a_silent_node_as_lost(task_identity):
    def handler(m):
        node = m.metadata.dst_node_id
        return {11: flwr_app.RecordDict({}), 22: RuntimeError("CUDA out of memory"), 33: None}[node]

    grid = FakeGrid(handler)
    msgs = [(cid, flwr_app.Message(flwr_app.RecordDict({}), dst_node_id=node, message_type="train"))
            for cid, node in ((0, 11), (1, 22), (2, 33))]
    replies, lost = flower_runner._exchange(grid, msgs, timeout=0.3)
    assert sorted(replies) == [0]
    assert lost == {1: "node error: CUDA out of memory", 2: "no reply within 0.3 s"}


def _query_handler(configs):
    def handler(m):
        pid, parts = configs[m.metadata.dst_node_id]
        return flwr_app.RecordDict({flower_wire.CONTROL: flwr_app.ConfigRecord({"partition-id": pid, "num-partitions": parts})})
    return handler


def test_discover_nodes_hosts_clients_round_robin_by_partition_id(task_identity):
    grid = FakeGrid(_query_handler({11: (0, 2), 22: (1, 2)}))
    node_of = flower_runner.discover_nodes(grid, 5, timeout=2)
    assert node_of == {0: 11, 1: 22, 2: 11, 3: 22, 4: 11}
    # errors name a node by its partition-id too: an operator starts SuperNodes by partition-id
    assert flower_runner.node_name(node_of, 3) == "node 22 (partition-id=1)"


def test_discover_nodes_names_the_clients_no_node_hosts(task_identity):
    grid = FakeGrid(_query_handler({11: (0, 3), 22: (1, 3)}))
    with pytest.raises(UserInputError, match=r"no connected SuperNode hosts client\(s\) \[2, 5\] of the 6 clients"):
        flower_runner.discover_nodes(grid, 6, timeout=0.5)
    grid = FakeGrid(_query_handler({11: (0, 2), 22: (0, 2)}))
    with pytest.raises(UserInputError, match="nodes 11 and 22 both host client 0"):
        flower_runner.discover_nodes(grid, 2, timeout=0.5)


def test_discover_nodes_names_a_node_whose_partition_id_is_out_of_range_at_once(task_identity, capsys):
    """Node 22 started with partition-id=3 num-partitions=2 used to be accepted (hosting clients 3,
    5, ... of a larger run) and the run to fail after the timeout blaming only the missing client 1;
    the error now names the node, without waiting. A node config that is no integer (the node's
    query used to fail, and the server to ask again until the timeout) is named the same way."""
    # timeout=0: only an error found in the first pass over the answers is this one (a node asked again
    # until the timeout would end in "no connected SuperNode hosts client(s)")
    with pytest.raises(UserInputError, match=r"^node_config.partition-id: node 22 has partition-id=3 with "
                                             r"num-partitions=2; allowed: 0..1; restart it with --node-config"):
        flower_runner.discover_nodes(FakeGrid(_query_handler({11: (0, 2), 22: (3, 2)})), 4, timeout=0)
    with pytest.raises(UserInputError, match=r"node 11 has num-partitions=0; allowed: an integer >= 1"):
        flower_runner.discover_nodes(FakeGrid(_query_handler({11: (0, 0)}), nodes=[11]), 2, timeout=0)
    grid = DirectGrid(2)
    grid.contexts[2].node_config["partition-id"] = "one"
    with pytest.raises(UserInputError, match=r"^node_config: node 2: partition-id='one' is not an integer; restart it"):
        flower_runner.discover_nodes(grid, 2, timeout=0)
    # a valid partition-id beyond the run's clients hosts nothing: the run goes on, with a warning
    three = {11: (0, 3), 22: (1, 3), 33: (2, 3)}
    node_of = flower_runner.discover_nodes(FakeGrid(_query_handler(three), nodes=three), 2, timeout=60)
    assert node_of == {0: 11, 1: 22}
    assert "warning: node 33 (partition-id=2 num-partitions=3) hosts none of the run's 2 clients" in capsys.readouterr().err


def test_flower_run_config_paths_must_be_absolute(tmp_path):
    with pytest.raises(UserInputError, match=r"run_config.config: is 'run.yaml'; allowed: an absolute path"):
        flower_app._load_from_run_config({"config": "run.yaml", "out": str(tmp_path)})
    with pytest.raises(UserInputError, match="nothing to resume"):
        flower_app._load_from_run_config({"resume": str(tmp_path)})


@pytest.mark.parametrize("key, value, msg", [
    ("rounds", -1, "run_config.rounds: is -1; allowed: 0 (the config's engine.rounds) or an integer >= 1"),
    ("rounds", 2.7, "run_config.rounds: is 2.7; allowed: 0"),
    ("rounds", "abc", "run_config.rounds: is 'abc'; allowed: 0"),
    ("rounds", True, "run_config.rounds: is True; allowed: 0"),
    ("resume", 0, "run_config.resume: is 0; allowed: an absolute path in quotes"),
    ("config", 1.5, "run_config.config: is 1.5; allowed: an absolute path in quotes"),
])
def test_flower_run_config_values_of_the_wrong_kind_are_named(tmp_path, key, value, msg):
    """`--run-config "rounds=-1"` used to be ignored (the YAML's rounds ran), 2.7 became 2, 'abc'
    raised a bare ValueError, and `resume=0` meant no resume: each is one error naming the key."""
    with pytest.raises(UserInputError) as err:
        flower_app._load_from_run_config({"out": str(tmp_path), key: value})
    assert str(err.value).startswith(msg), str(err.value)


def test_flower_run_config_rounds_accepts_whole_numbers_and_out_must_be_a_folder(tmp_path):
    assert [flower_app._run_config_rounds(v) for v in (0, 3, 3.0, "4")] == [0, 3, 3, 4]
    (tmp_path / "file").write_text("")
    with pytest.raises(UserInputError, match="run_config.out: is a file; allowed: a new or existing folder"):
        flower_app._load_from_run_config({"out": str(tmp_path / "file")})


@pytest.mark.slow
def test_flower_run_config_resume_rounds_and_yaml_relative_paths(tmp_path, deployed):
    from rafl.federation.run_config import load_run_config

    with pytest.raises(UserInputError, match="run_config.rounds: is 1 but the run has completed 2 rounds; allowed: an "
                                             "integer >= 2"):
        flower_app._load_from_run_config({"resume": str(deployed), "rounds": 1})
    # loading a resume changes nothing in the run dir: its config.yaml is rewritten (engine.rounds)
    # only once the resumed run succeeded, as `rafl federate --resume` does
    before = (deployed / "config.yaml").read_text()
    prep, run_dir, resume = flower_app._load_from_run_config({"resume": str(deployed), "rounds": 5})
    assert resume and run_dir == deployed and prep.cfg.engine.rounds == 5
    assert (deployed / "config.yaml").read_text() == before
    yaml_file = tmp_path / "cfg" / "run.yaml"  # a YAML's relative paths: against its folder (rafl.config)
    yaml_file.parent.mkdir()
    yaml_file.write_text("supernet: {path: sn}\ndata: {root: ../data}\n")
    cfg = load_run_config(yaml_file)
    assert cfg.supernet.path == str(tmp_path / "cfg" / "sn") and cfg.data.root == str(tmp_path / "data")


@pytest.mark.slow
def test_a_superlink_run_records_its_backend_and_rafl_federate_resume_refuses_it(deployed, in_process):
    """A run made on a SuperLink (the Flower App) records it: config.yaml's engine.backend: flower,
    clients.json's deployment, summary.json's backend. `rafl federate --resume` of it, on either
    backend, stops at once with the `flwr run` command that resumes it (it used to start in-process
    and fail on the first client's missing state file: the states are on the nodes' disks), and
    the App refuses a run dir whose client states are in its clients/ folder."""
    import yaml

    assert _rows(deployed) == _rows(in_process)
    assert yaml.safe_load((deployed / "config.yaml").read_text())["engine"]["backend"] == "flower"
    assert json.loads((deployed / "clients.json").read_text())["deployment"]["runtime"] == "superlink"
    assert json.loads((deployed / "summary.json").read_text())["backend"] == "flower-superlink"
    assert json.loads((in_process / "summary.json").read_text())["backend"] == "in-process"
    files = {p: p.read_bytes() for p in deployed.rglob("*") if p.is_file()}
    for backend in ([], ["--set", "engine.backend=in-process"], ["--set", "engine.backend=flower"]):
        res = CliRunner().invoke(cli, ["federate", "--no-progress", "--resume", str(deployed), "--set", "engine.rounds=3",
                                       *backend])
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1, res.output
        assert "--resume: ran on a SuperLink (rafl flower-app): its client states are on the SuperNodes' disks" in lines[0]
        assert lines[0].endswith(f"flwr run <app> <federation> --run-config \"resume='{deployed.resolve()}'\"")
    assert {p: p.read_bytes() for p in deployed.rglob("*") if p.is_file()} == files
    with pytest.raises(UserInputError, match=r"run_config.resume: ran in-process or on the Simulation Runtime: .* "
                                             f"rafl federate --resume {in_process}$"):
        flower_app._load_from_run_config({"resume": str(in_process)})


def test_flower_app_command_writes_the_app_once(tmp_path):
    res = CliRunner().invoke(cli, ["flower-app", "--out", str(tmp_path / "app"), "--runs", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "app" / "pyproject.toml").read_text()
    assert 'serverapp = "rafl.stages.flower.app:server_app"' in text and str(tmp_path / "runs") in text
    again = CliRunner().invoke(cli, ["flower-app", "--out", str(tmp_path / "app")])
    assert again.exit_code == 2 and "already holds a pyproject.toml" in again.output


@pytest.mark.parametrize("text, msg", [
    ("engine: {roundz: 2}\n", "run.yaml: engine.roundz: unknown key; allowed: rounds"),
    ("algorithm: {name: fedfoo}\n", "run.yaml: algorithm.name: unknown algorithm 'fedfoo'"),
    ("algorithm: {name: fedgh, server_mode: sideways}\n", "run.yaml: algorithm.server_mode: is 'sideways'"),
    ("clients: {models: 'htfe4,bogus'}\n", "run.yaml: clients.models: unknown model 'bogus'; allowed: nas, a group"),
])
def test_flower_app_checks_the_run_config_before_writing(tmp_path, text, msg):
    """`flwr run` exits 0 whatever the ServerApp meets, so a bad run config is caught here."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    res = CliRunner().invoke(cli, ["flower-app", "--out", str(tmp_path / "app"), "--config", str(cfg)])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and msg in lines[0], res.output
    assert not (tmp_path / "app").exists()


def test_more_virtual_supernodes_than_clients_is_an_error_before_anything_is_written(tmp_path, supernet_dir,
                                                                                    monkeypatch):
    """engine.supernodes=4 with 3 clients used to run with an idle virtual SuperNode (exit 0): an
    error naming the allowed range now, before the Simulation Runtime starts and with no run dir."""
    import flwr.simulation

    def no_ray(*args, **kwargs):
        raise AssertionError(f"the Simulation Runtime started with {kwargs.get('num_supernodes')} virtual SuperNodes")

    monkeypatch.setattr(flwr.simulation, "run_simulation", no_ray)
    res = CliRunner().invoke(cli, ["federate", "--no-progress", "--out", str(tmp_path / "runs"), "--set", "name=r",
                                   "--set", f"supernet.path={supernet_dir}", *ARGS, "--set", "engine.backend=flower",
                                   "--set", "engine.supernodes=4"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0] == ("error: --set: engine.supernodes: is 4 but the run has 3 clients (clients.n); allowed: 1..3 "
                        "(virtual SuperNode I hosts clients I, I+P, I+2P, ...), or null for one per client")
    assert not (tmp_path / "runs").exists()


def test_compare_refuses_the_flower_backend(tmp_path):
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", "--set", "engine.backend=flower",
                                   "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 2 and "engine.backend: is 'flower'; rafl compare runs its methods in-process" in res.output
    assert not (tmp_path / "cmp").exists()


class DirectGrid(FakeGrid):
    """A grid that hands every message to rafl's ClientApp in this process (nodes 1..n with
    node config partition-id / num-partitions; an exception becomes an error reply, as on a
    SuperNode). Exercises the whole message path without Ray or processes."""

    def __init__(self, n_nodes: int):
        from flwr.app import Context

        self.contexts = {i + 1: Context(run_id=1, node_id=i + 1, state=flwr_app.RecordDict(), run_config={},
                                        node_config={"partition-id": i, "num-partitions": n_nodes})
                         for i in range(n_nodes)}
        super().__init__(None, nodes=self.contexts)

    def answer(self, m):
        try:
            return flower_app.client_app(m, self.contexts[m.metadata.dst_node_id])
        except Exception as err:  # noqa: BLE001 - a SuperNode turns it into an error reply
            return Exception(f"{type(err).__name__}: {err}")


ALL_METHODS = ["rafl", "fedgh", "fedtgp", "fedproto", "lg-fedavg", "fd", "fml", "fedkd", "feddf", "standalone",
               "fedavg", "fedprox", "fednova", "heterofl", "fedrolex", "uniform", "pretrained", "centralized"]


#: the methods whose Flower equivalence the fast loop keeps (12-35 s each on 2 loaded cores), one per kind of
#: exchange: a knowledge network (rafl), class-wise representations and a global header (fedgh), whole models
#: (fedavg); the others are `slow` (CI runs all)
QUICK_METHODS = ("rafl", "fedgh", "fedavg")


@pytest.mark.parametrize("method", [m if m in QUICK_METHODS else pytest.param(m, marks=pytest.mark.slow)
                                    for m in ALL_METHODS])
def test_every_method_computes_the_same_run_through_flower_messages(tmp_path, supernet_dir, task_identity, method):
    """Each registered method, its broadcasts, uploads and client states carried by Flower
    messages to ClientApps on two nodes (three clients), ends with the in-process numbers."""
    from rafl.federation.algorithms.base import ALGORITHMS
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    assert sorted(ALL_METHODS) == sorted(ALGORITHMS)  # a new method joins this test
    same_model = ["clients.arch=r16_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3"]
    three_models = ["clients.archs={pi4: r16_k7e6.k3e4|k7e4.k5e6|k7e4.k3e3|k5e3.k7e4|k3e3.k3e4, "  # no search
                    "jetson-nano: r16_k7e4.k7e4.k3e6|k7e4.k5e3.k7e3|k7e3.k5e3|k5e3.k7e4|k5e3.k7e6.k5e3, "
                    "phone: r16_k5e4.k3e4|k3e4.k5e6.k7e3|k7e3.k7e4.k5e4.k5e6|k5e6.k7e4.k7e4|k5e6.k5e6.k3e4.k3e4}"]
    sets = [f"supernet.path={supernet_dir}", "data.limit_per_class=10", "clients.n=3", "engine.rounds=2",
            f"algorithm.name={method}", *(same_model if method in ("fedavg", "fedprox", "fednova") else three_models)]
    prep = federate.prepare(load_run_config(None, sets), progress=False)
    ref = federate.run(prep, tmp_path / "ref", progress=False)
    got = flower_app.run_on_grid(DirectGrid(2), prep, tmp_path / "msg", progress=False)  # nodes prepare their own
    rows = _rows(tmp_path / "ref")
    assert [r.get("rejected", 0) for r in rows] == [0] * len(rows), rows[0].get("rejected_reasons")  # honest clients
    assert _rows(tmp_path / "msg") == rows
    assert got["final"] == ref["final"] and got["cum_bytes_up"] == ref["cum_bytes_up"]
    assert sorted(f.name for f in (tmp_path / "node-states").rglob("*.st")) == [
        "0000000.r00002.st", "0000001.r00002.st", "0000002.r00002.st"]


class FaultyGrid(DirectGrid):
    """A :class:`DirectGrid` whose node ``dead`` stops replying from round ``dead_from`` on, and
    which raises :class:`flower_runner.Stopped` (Ctrl-C) after delivering the ``interrupt`` =
    ``(message type, round)`` messages."""

    def __init__(self, n_nodes, dead=None, dead_from=1, interrupt=None):
        super().__init__(n_nodes)
        self.dead, self.dead_from, self.interrupt = dead, dead_from, interrupt

    def answer(self, m):
        if m.metadata.dst_node_id == self.dead and int(m.metadata.group_id or 0) >= self.dead_from:
            return None  # never answered
        return super().answer(m)

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        if self.interrupt and any((m.metadata.message_type, int(m.metadata.group_id or 0)) == self.interrupt
                                  for m in messages):
            raise flower_runner.Stopped("Ctrl-C")
        return ids


def _tiny_sets(supernet_dir, method="fedgh", rounds=3):
    return [f"supernet.path={supernet_dir}", "data.limit_per_class=10", "clients.n=3", f"engine.rounds={rounds}",
            f"algorithm.name={method}", "engine.round_timeout_s=1",
            "clients.archs={pi4: r16_k7e6.k3e4|k7e4.k5e6|k7e4.k3e3|k5e3.k7e4|k3e3.k3e4, "
            "jetson-nano: r16_k7e4.k7e4.k3e6|k7e4.k5e3.k7e3|k7e3.k5e3|k5e3.k7e4|k5e3.k7e6.k5e3, "
            "phone: r16_k5e4.k3e4|k3e4.k5e6.k7e3|k7e3.k7e4.k5e4.k5e6|k5e6.k7e4.k7e4|k5e6.k5e6.k3e4.k3e4}"]


@pytest.mark.slow
def test_interrupted_evaluation_keeps_the_checkpointed_client_states(tmp_path, supernet_dir, task_identity):
    """Ctrl-C while round 2 is being evaluated: the nodes keep the round-1 states the checkpoint
    names (evaluation deletes nothing), and the resumed run ends with the uninterrupted numbers."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir)), progress=False)
    ref = flower_app.run_on_grid(DirectGrid(2), prep, tmp_path / "ref", progress=False)
    with pytest.raises(flower_runner.Stopped):
        flower_app.run_on_grid(FaultyGrid(2, interrupt=("evaluate", 2)), prep, tmp_path / "cut", progress=False)
    assert len(_rows(tmp_path / "cut")) == 1  # round 1 is the last complete round
    got = flower_app.run_on_grid(DirectGrid(2), prep, tmp_path / "cut", resume=True, progress=False)
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "ref") and got["final"] == ref["final"]


def test_a_run_stopped_before_its_first_complete_round_leaves_no_client_states_on_the_nodes(
        tmp_path, supernet_dir, task_identity):
    """Ctrl-C while round 1 is evaluated: the nodes had written round-1 states, but without a
    checkpoint no resume can use them, so the server tells the nodes to delete the run's folder."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir)), progress=False)
    grid = FaultyGrid(2, interrupt=("evaluate", 1))
    written = []
    answer = grid.answer
    grid.answer = lambda m: (written.extend(p.name for p in (tmp_path / "node-states").glob("*/*")), answer(m))[1]
    with pytest.raises(flower_runner.Stopped):
        flower_app.run_on_grid(grid, prep, tmp_path / "run", progress=False)
    assert written, "round 1's training wrote no client state"
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()
    assert list((tmp_path / "node-states").iterdir()) == []


@pytest.mark.slow
def test_a_dead_node_loses_its_clients_and_the_run_completes(tmp_path, supernet_dir, task_identity):
    """Node 2 (client 1) stops replying in round 2: client 1 counts as failed in training and is
    left out of the evaluation (named with the reason); the run still ends after 3 rounds."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir)), progress=False)
    summary = flower_app.run_on_grid(FaultyGrid(2, dead=2, dead_from=2), prep, tmp_path / "run", progress=False)
    rows = _rows(tmp_path / "run")
    assert summary["rounds"] == 3 and [r["failed"] for r in rows] == [0, 1, 1]
    why = "node 2 (partition-id=1): no reply within 1 s"
    assert rows[1]["lost"] == {"1": why} and rows[2]["eval_lost"] == {"1": why}
    assert sorted(summary["clients"]) == ["0", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("shared_disk", [False, True], ids=["superlink", "simulation"])
def test_one_clients_error_on_its_node_is_that_clients_failure_as_in_process(tmp_path, supernet_dir, task_identity,
                                                                             monkeypatch, shared_disk):
    """Client 1's step raises a UserInputError in every round (a hostile or broken node): on Flower
    (a SuperLink's semantics, and the Simulation Runtime's: states on the shared disk) as in-process,
    it is left out of each round with its reason (naming its node on Flower), its state is never
    committed, and the run completes with the same numbers as in-process."""
    from rafl.federation.algorithms import ALGORITHMS
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    base = ALGORITHMS["fedgh"]
    honest = base.client_update

    def client_update(self, state, broadcast, client):
        if client.client_id == 1:
            raise UserInputError("local training diverged (loss nan)", field="algorithm.lr")
        return honest(self, state, broadcast, client)

    monkeypatch.setattr(base, "client_update", client_update)
    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir, rounds=2)), progress=False)
    ref = federate.run(prep, tmp_path / "ref", progress=False)
    grid = DirectGrid(2)
    if shared_disk:  # the virtual SuperNodes' trust settings: the run dir's client states are theirs
        from rafl.stages.flower import node as flower_node_mod

        own = flower_node_mod.own_node_config(prep.cfg, tmp_path / "msg" / "clients")
        for ctx in grid.contexts.values():
            ctx.node_config.update(own)
    got = flower_app.run_on_grid(grid, prep, tmp_path / "msg", progress=False, shared_disk=shared_disk)
    rows, ref_rows = _rows(tmp_path / "msg"), _rows(tmp_path / "ref")
    model = f"client 1 (model {prep.federation.clients[1].model_key})"
    why = ": its client step failed: algorithm.lr: local training diverged (loss nan)"
    assert [r["rejected_reasons"] for r in ref_rows] == [{"1": model + why}] * 2 and ref["failed_rounds"] == 0
    assert [r["rejected_reasons"] for r in rows] == [{"1": f"{model} on node 2 (partition-id=1){why}"}] * 2, rows
    assert [{k: v for k, v in r.items() if k != "rejected_reasons"} for r in rows] == \
        [{k: v for k, v in r.items() if k != "rejected_reasons"} for r in ref_rows]
    assert got["final"] == ref["final"] and got["rejected_uploads"] == 2


@pytest.mark.slow
def test_a_client_error_of_every_client_stops_the_run_as_in_process(tmp_path, supernet_dir, task_identity):
    """Diverged local training of every client (fewer than engine.min_valid_uploads clients remain)
    is the run's fault: the same one-line error as in-process (naming the first client in job order,
    its model and the node), no round committed."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, [*_tiny_sets(supernet_dir), "algorithm.lr=1e12",
                                                   "engine.workers=1"]), progress=False)
    with pytest.raises(UserInputError) as in_process:
        federate.run(prep, tmp_path / "a", progress=False)
    with pytest.raises(UserInputError) as on_flower:
        flower_app.run_on_grid(DirectGrid(2), prep, tmp_path / "b", progress=False)
    assert "diverged" in on_flower.value.message and on_flower.value.message == in_process.value.message
    cid = int(in_process.value.source.split()[1])
    assert on_flower.value.source == f"{in_process.value.source} on node {cid % 2 + 1} (partition-id={cid % 2})"
    assert not (tmp_path / "b" / "checkpoint.safetensors").exists()


class CountingGrid(DirectGrid):
    """A :class:`DirectGrid` that records ``(message type, round, node, client ids)`` and the
    number of payload records of every message."""

    def __init__(self, n_nodes):
        super().__init__(n_nodes)
        self.sent, self.payloads, self.blob_bytes = [], [], []

    def answer(self, m):
        ctl = m.content.config_records.get(flower_wire.CONTROL)
        ids = [int(c) for c in ctl["client_ids"]] if ctl is not None and "client_ids" in ctl else []
        self.sent.append((m.metadata.message_type, int(m.metadata.group_id or 0), m.metadata.dst_node_id, ids))
        self.payloads.append(sum(1 for k in m.content.array_records if k.startswith(flower_wire.PAYLOAD)))
        self.blob_bytes.append(sum(r[flower_wire.BLOB].numpy().nbytes for k, r in m.content.array_records.items()
                                   if k.startswith(flower_wire.PAYLOAD)))
        return super().answer(m)


@pytest.mark.slow
def test_one_message_per_node_carries_all_its_clients_and_a_failed_client_step_loses_that_client_only(
        tmp_path, supernet_dir, task_identity, monkeypatch):
    """Five clients on two nodes: each round sends one train and one evaluate message per node
    (a deployed SuperNode starts a process per message), each carrying the node's clients in job
    order, and the run computes the in-process numbers. A client step failing on its node with an
    unexpected error (not a UserInputError) loses that client for the round, not its node-mates."""
    from rafl.federation import runners
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    sets = [s.replace("clients.n=3", "clients.n=5") for s in _tiny_sets(supernet_dir, rounds=2)]
    prep = federate.prepare(load_run_config(None, sets), progress=False)
    ref = federate.run(prep, tmp_path / "ref", progress=False)
    grid = CountingGrid(2)
    got = flower_app.run_on_grid(grid, prep, tmp_path / "msg", progress=False)
    assert _rows(tmp_path / "msg") == _rows(tmp_path / "ref") and got["final"] == ref["final"]
    steps = [s for s in grid.sent if s[0] in ("train", "evaluate")]
    assert steps == [(kind, rnd, node, ids) for rnd in (1, 2) for kind in ("train", "evaluate")
                     for node, ids in ((1, [0, 2, 4]), (2, [1, 3]))]
    # the evaluation broadcast is common to all: it travels once per message
    assert [n for (kind, *_), n in zip(grid.sent, grid.payloads) if kind == "evaluate"] == [1, 1, 1, 1]
    # traffic as sent beside the per-client payload bytes: what the messages carried, counted from them
    rows = [json.loads(line) for line in (tmp_path / "msg" / "metrics.jsonl").read_text().splitlines()]
    for rnd, row in enumerate(rows, 1):
        sent = {kind: sum(b for (k, r, *_), b in zip(grid.sent, grid.blob_bytes) if (k, r) == (kind, rnd))
                for kind in ("train", "evaluate")}
        assert row["wire_bytes_down"] == sent["train"] and row["wire_bytes_eval_down"] == sent["evaluate"]
        assert row["wire_bytes_up"] == row["bytes_up"]  # every upload is its client's own
        assert 0 < row["wire_bytes_down"] <= row["bytes_down"]
    assert got["cum_wire_mb"] == pytest.approx(sum(r["wire_bytes_down"] + r["wire_bytes_up"] for r in rows) / 1e6)
    assert got["cum_wire_bytes_eval_down"] == sum(r["wire_bytes_eval_down"] for r in rows)

    real = runners.train_client

    def flaky(fed, store, ctx, down):
        if ctx.info.client_id == 2 and ctx.round == 2:
            raise RuntimeError("CUDA out of memory")
        return real(fed, store, ctx, down)

    monkeypatch.setattr(flower_node, "train_client", flaky)
    flower_app.run_on_grid(CountingGrid(2), prep, tmp_path / "flaky", progress=False)
    rows = _rows(tmp_path / "flaky")
    assert [r["failed"] for r in rows] == [0, 1]
    assert rows[1]["lost"] == {"2": "node 1 (partition-id=0): node error: RuntimeError: CUDA out of memory"}


@pytest.mark.slow
def test_a_node_whose_uploads_would_pass_the_reply_bound_gets_several_train_messages(
        tmp_path, supernet_dir, task_identity, monkeypatch):
    """With the reply bound below two clients' upload limits, each train message carries one
    client (node 1: three messages, node 2: two), evaluation stays one message per node, and the
    run computes the in-process numbers."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    sets = [s.replace("clients.n=3", "clients.n=5") for s in _tiny_sets(supernet_dir, rounds=2)]
    prep = federate.prepare(load_run_config(None, sets), progress=False)
    ref = federate.run(prep, tmp_path / "ref", progress=False)
    grid = CountingGrid(2)
    limits: list[int] = []
    real = flower_runner.FlowerClients._batches

    def batches(kind, jobs, upload_limits):
        limits.extend(upload_limits.get(cid) for cid, _ in jobs if kind == "train")
        return real(kind, jobs, upload_limits)

    monkeypatch.setattr(flower_runner.FlowerClients, "_batches", staticmethod(batches))
    monkeypatch.setattr(flower_runner, "MAX_REPLY_BYTES", 1)  # every client alone exceeds it: one per message
    got = flower_app.run_on_grid(grid, prep, tmp_path / "msg", progress=False)
    assert _rows(tmp_path / "msg") == _rows(tmp_path / "ref") and got["final"] == ref["final"]
    assert limits and all(limit > 1 for limit in limits)
    steps = [s for s in grid.sent if s[0] in ("train", "evaluate")]
    assert steps == [step for rnd in (1, 2) for step in
                     [("train", rnd, 1, [0]), ("train", rnd, 1, [2]), ("train", rnd, 1, [4]), ("train", rnd, 2, [1]),
                      ("train", rnd, 2, [3]), ("evaluate", rnd, 1, [0, 2, 4]), ("evaluate", rnd, 2, [1, 3])]]


def test_reply_batches_fill_up_to_the_bound_in_job_order(monkeypatch):
    monkeypatch.setattr(flower_runner, "MAX_REPLY_BYTES", 100)
    limits = {0: 40, 1: 40, 2: 40, 3: 150, 4: 10}
    jobs = [(cid, Payload()) for cid in range(5)]
    got = flower_runner.FlowerClients._batches("train", jobs, limits)
    assert [[cid for cid, _ in b] for b in got] == [[0, 1], [2], [3], [4]]  # a client alone may pass it
    assert [[cid for cid, _ in b] for b in flower_runner.FlowerClients._batches("evaluate", jobs, limits)] == [[0, 1, 2, 3, 4]]


@pytest.mark.slow
def test_a_slow_node_replies_with_the_clients_done_before_the_round_timeout(tmp_path, supernet_dir, task_identity,
                                                                            monkeypatch):
    """Node 1 hosts clients 0, 2, 4 and each training step takes 0.4 s on its clock (moved by the
    step, not by the machine's load) against a 1 s round timeout: after two steps (0.8 s, mean
    0.4 s) a third would end past 0.9 s, so client 4 is not started and is lost alone, named with
    the reason; clients 0 and 2 count (a node used to lose its whole batch to the timeout)."""
    from rafl.federation import runners
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    sets = [s.replace("clients.n=3", "clients.n=5") for s in _tiny_sets(supernet_dir, rounds=1)]
    prep = federate.prepare(load_run_config(None, sets), progress=False)
    now = [0.0]
    real = runners.train_client

    def timed(fed, store, ctx, down):
        now[0] += 0.4
        return real(fed, store, ctx, down)

    monkeypatch.setattr(flower_node, "_clock", lambda: now[0])
    monkeypatch.setattr(flower_node, "train_client", timed)
    flower_app.run_on_grid(DirectGrid(2), prep, tmp_path / "run", progress=False)
    (row,) = _rows(tmp_path / "run")
    assert row["failed"] == 1 and row["participated"] == 4
    assert row["lost"] == {"4": "node 1 (partition-id=0): node error: not started: this node's earlier clients took "
                                "0.8 s of the 1 s round timeout (engine.round_timeout_s)"}


class RestartGrid(DirectGrid):
    """A :class:`DirectGrid` whose node 2 (partition-id 1) goes away after round 1 and comes back
    as node 3 with the same node config (a restarted SuperNode gets a new node id)."""

    def __init__(self):
        super().__init__(2)
        self.contexts[3] = self.contexts[2]
        self.gone = False

    def get_node_ids(self):
        return [1, 3] if self.gone else [1, 2]

    def answer(self, m):
        if m.metadata.dst_node_id == 2 and self.gone:
            return None
        reply = super().answer(m)
        if (m.metadata.message_type, m.metadata.group_id, m.metadata.dst_node_id) == ("evaluate", "1", 2):
            self.gone = True  # after its round-1 evaluation
        return reply


@pytest.mark.slow
def test_a_restarted_supernode_takes_its_clients_back(tmp_path, supernet_dir, task_identity):
    """Node 2 leaves after round 1 and rejoins as node 3 with the same partition-id: from round 2
    on its clients are sent to node 3 (they used to stay lost for the rest of the run), and with
    the client states kept on its disk the run computes the in-process numbers."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir)), progress=False)
    ref = federate.run(prep, tmp_path / "ref", progress=False)
    got = flower_app.run_on_grid(RestartGrid(), prep, tmp_path / "msg", progress=False)
    assert _rows(tmp_path / "msg") == _rows(tmp_path / "ref") and got["final"] == ref["final"]


def test_every_client_lost_stops_the_run(tmp_path, supernet_dir, task_identity):
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir, rounds=1)), progress=False)
    grid = FaultyGrid(1, dead=1, dead_from=1)
    with pytest.raises(UserInputError, match=r"round 1: all 3 sampled clients were lost \(client 0: node 1 "
                                             r"\(partition-id=0\): no reply within 1 s\)"):
        flower_app.run_on_grid(grid, prep, tmp_path / "run", progress=False)


# ---------------------------------------------------------------------- the node's trust boundary
def _node(node_config=None, node_id=1):
    """A node's Context: partition 0 of 1 plus ``node_config`` (its operator's settings)."""
    return flwr_app.Context(run_id=1, node_id=node_id, state=flwr_app.RecordDict(), run_config={},
                            node_config={"partition-id": 0, "num-partitions": 1, **(node_config or {})})


def _forged(kind, control):
    """A message as anyone who reaches the SuperLink could send it to a node."""
    return flwr_app.Message(flwr_app.RecordDict({flower_wire.CONTROL: flwr_app.ConfigRecord(control)}), dst_node_id=1,
                            message_type=kind)


def _step_control(config: dict, **extra):
    import yaml

    from rafl.config import RunConfig

    text = yaml.safe_dump(RunConfig.model_validate(config).resolved(), sort_keys=True)
    return {"client_ids": [0], "slots": [0], "state_versions": [-1], "round": 1, "run_key": "0123456789abcdef",
            "config": text, "state_dir": "", **extra}


def test_a_forged_message_cannot_make_a_node_import_a_plug_in(tmp_path, monkeypatch, task_identity):
    """A train message whose run config names a plug-in model the node's config does not list is
    refused before anything is imported (the module would have left a marker), with one line naming
    the node-config key, and counted in the node's refused.jsonl; a listed plug-in is allowed."""
    from rafl.config import RunConfig

    (tmp_path / "evilmod.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                         "def make(**kw):\n    raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ctl = _step_control({"clients": {"models": "evilmod:make,cnn4"}})
    reply = flower_app.client_app(_forged("train", ctl), _node({"plugins": "other.mod:make"}))
    rec = reply.content.config_records[flower_wire.CONTROL]
    assert rec["refused"] is True and rec["user_error_field"] == "node_config.plugins"
    assert rec["user_error"].startswith("the message's clients.models names plug-in 'evilmod:make', which this "
                                        "node does not allow (plugins: other.mod:make)")
    assert not (tmp_path / "imported").exists() and "evilmod" not in __import__("sys").modules
    (row,) = flower_node.refusals(tmp_path / "node-states")  # the env's state-dir of this node
    assert row["message_type"] == "train" and row["field"] == "node_config.plugins"
    assert not (tmp_path / "node-states" / "0123456789abcdef").exists()  # nothing written for the run
    trust = flower_node.NodeTrust.of({"plugins": "other.mod:make, evilmod:make"})  # the message chooses among them
    trust.check_run_config(RunConfig.model_validate({"clients": {"models": "evilmod:make,cnn4"}}))
    assert not (tmp_path / "imported").exists()


def test_a_forged_message_cannot_make_a_node_read_a_path_outside_its_data_roots(tmp_path, task_identity, monkeypatch):
    """Every input path a run config names (supernet, data root, partition file, profile and arch
    files) must lie in the node's data-roots, symlinks resolved; the first outside is refused and
    counted, and a path inside is the message's choice to make."""
    from rafl.config import RunConfig

    roots = tmp_path / "data"
    (roots / "cifar").mkdir(parents=True)
    (roots / "escape").symlink_to(tmp_path / "secret", target_is_directory=True)
    node = {"data-roots": f"{roots}{os.pathsep}{tmp_path / 'nets'}", "state-dir": str(tmp_path / "states")}
    forged = [({"supernet": {"path": "/etc"}}, "supernet.path", "/etc"),
              ({"data": {"dataset": "cifar10", "root": str(roots / "escape")}}, "data.root", str(roots / "escape")),
              ({"data": {"root": str(roots / ".." / "secret")}}, "data.root", str(roots / ".." / "secret")),
              ({"partition": {"scheme": f"file:{tmp_path / 'p.json'}"}}, "partition.scheme", str(tmp_path / "p.json")),
              ({"clients": {"profiles": [str(tmp_path / "pi.yaml")]}}, "clients.profiles", str(tmp_path / "pi.yaml")),
              ({"clients": {"arch": str(tmp_path / "a.yaml")}}, "clients.arch", str(tmp_path / "a.yaml"))]
    for n, (config, field, path) in enumerate(forged, 1):
        reply = flower_app.client_app(_forged("evaluate", _step_control(config)), _node(node))
        rec = reply.content.config_records[flower_wire.CONTROL]
        assert rec["refused"] is True and rec["user_error_field"] == "node_config.data-roots", (config, rec)
        assert rec["user_error"].startswith(f"the message's {field} names {path!r}, outside this node's data-roots")
        assert len(flower_node.refusals(tmp_path / "states")) == n
    trust = flower_node.NodeTrust.of(node)
    trust.check_run_config(RunConfig.model_validate({"data": {"dataset": "cifar10", "root": str(roots / "cifar")},
                                                     "supernet": {"path": str(tmp_path / "nets" / "s1")}}))
    monkeypatch.delenv("RAFL_FLOWER_DATA_ROOTS")  # a node whose operator allowed no folder
    with pytest.raises(flower_node.Refused, match="outside this node's data-roots \\(none\\)"):
        flower_node.NodeTrust.of({}).check_run_config(RunConfig.model_validate({"supernet": {"path": str(roots)}}))


def test_a_forged_discard_or_run_key_cannot_make_a_node_delete_or_write_a_foreign_folder(tmp_path, task_identity):
    """`discard` of a folder the message names, a run key that is a path, or a state folder the
    node did not share is refused (and counted); the foreign folder stays. A discard of the node's
    own <state-dir>/<run key> deletes it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    states = tmp_path / "node-states"  # the env's state-dir of these nodes
    forged = [("query", {"ask": "discard", "run_key": "victim", "state_dir": str(victim)}),
              ("query", {"ask": "discard", "run_key": "../victim", "state_dir": ""}),
              ("query", {"ask": "commit", "run_key": "0123456789abcdef", "state_dir": str(victim),
                         "committed": "{}"}),
              ("train", _step_control({}, state_dir=str(victim))),
              ("train", _step_control({}, run_key="../victim"))]
    for n, (kind, ctl) in enumerate(forged, 1):
        reply = flower_app.client_app(_forged(kind, ctl), _node())
        rec = reply.content.config_records[flower_wire.CONTROL]
        assert "refused" in rec and rec["refused"] is not False, (ctl, rec)
        assert (victim / "keep.txt").is_file() and len(flower_node.refusals(states)) == n
    assert [r["field"] for r in flower_node.refusals(states)] == [  # a run key that is no key is refused first
        "node_config.state-dir", "node_config.state-dir", "node_config.shared-state-dirs",
        "node_config.shared-state-dirs", "node_config.state-dir"]
    assert not (tmp_path / "victim" / "0123456789abcdef").exists()
    own = states / "0123456789abcdef"
    own.mkdir()
    (own / "0000000.r00001.st").write_bytes(b"")
    reply = flower_app.client_app(_forged("query", {"ask": "discard", "run_key": "0123456789abcdef", "state_dir": ""}),
                              _node())
    assert reply.content.config_records[flower_wire.CONTROL]["done"] and not own.exists()
    shared = flower_node.NodeTrust.of({"shared-state-dirs": str(victim)})  # an operator's explicit share
    assert shared.run_folder({"run_key": "0123456789abcdef", "state_dir": str(victim)}) == victim.resolve()


def test_a_run_the_nodes_refuse_stops_with_the_nodes_reason(tmp_path, supernet_dir, task_identity, monkeypatch):
    """rafl's own ServerApp, with a run config naming a supernet outside the nodes' data-roots: the
    run stops at round 1 with one line naming the node, the field and the node-config key."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    prep = federate.prepare(load_run_config(None, _tiny_sets(supernet_dir, rounds=1)), progress=False)
    monkeypatch.setenv("RAFL_FLOWER_DATA_ROOTS", str(tmp_path / "elsewhere"))
    with pytest.raises(UserInputError) as err:
        flower_app.run_on_grid(DirectGrid(2), prep, tmp_path / "run", progress=False)
    assert str(err.value).startswith("node 1 (partition-id=0) refused the train message: node_config.data-roots: the "
                                     f"message's supernet.path names {str(supernet_dir)!r}, outside this node's "
                                     "data-roots")
    assert len(flower_node.refusals(tmp_path / "node-states")) == 2  # both nodes counted it
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


# ---------------------------------------------------------------------- whole runs
@pytest.mark.slow
@pytest.mark.integration  # Ray, or a SuperLink with SuperNodes
def test_simulation_backend_matches_in_process_and_resumes_on_either(tmp_path, supernet_dir, in_process):
    """Flower's Simulation Runtime (Ray) computes the in-process engine's numbers; a run started on
    Flower resumes in-process from the same client states (the run dir's clients/)."""
    sn = ["--set", f"supernet.path={supernet_dir}"]
    _federate(["--out", str(tmp_path), "--set", "name=sim", *sn, *ARGS, "--set", "engine.backend=flower"])
    assert _rows(tmp_path / "sim") == _rows(in_process)
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["backend"] == "flower-simulation"
    _federate(["--out", str(tmp_path), "--set", "name=half", *sn, *ARGS, "--set", "engine.backend=flower",
               "--set", "engine.rounds=1"])
    _federate(["--resume", str(tmp_path / "half"), "--set", "engine.rounds=2", "--set", "engine.backend=in-process"])
    assert _rows(tmp_path / "half") == _rows(in_process)


@pytest.mark.slow
@pytest.mark.integration  # Ray, or a SuperLink with SuperNodes
def test_a_model_group_on_the_simulation_backend_matches_in_process(tmp_path):
    """Issue 7's model groups (`clients.models`) run on Flower too: the nodes rebuild the group from
    the run config, and every metric of every round equals the in-process run's."""
    group = [*ARGS, "--set", "clients.models=cnn4-small,cnn3-small", "--set", "clients.feature_dim=16"]
    _federate(["--out", str(tmp_path), "--set", "name=ref", *group])
    _federate(["--out", str(tmp_path), "--set", "name=sim", *group, "--set", "engine.backend=flower"])
    assert _rows(tmp_path / "sim") == _rows(tmp_path / "ref")
    assert [c["model"] for c in json.loads((tmp_path / "sim" / "clients.json").read_text())["clients"]] == \
        ["cnn4-small", "cnn3-small", "cnn4-small"]


@pytest.mark.slow
@pytest.mark.integration  # Ray, or a SuperLink with SuperNodes
def test_deployment_on_a_superlink_with_two_supernodes(tmp_path, supernet_dir, in_process):
    """`rafl flower-app` + `flwr run` against a real SuperLink and two SuperNodes hosting the three
    clients (node 0: clients 0 and 2, node 1: client 1), each node with `rafl flower-superexec`,
    ends with the in-process numbers; each warm process built the run once."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"name: deployed\nsupernet: {{path: {supernet_dir}}}\ndata: {{limit_per_class: 10}}\n"
                   "clients: {n: 3}\nengine: {rounds: 2, round_timeout_s: 300}\nalgorithm: {name: fedgh}\n")
    res = CliRunner().invoke(cli, ["flower-app", "--out", str(tmp_path / "app"), "--config", str(cfg),
                                   "--runs", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    with flower_fleet.LocalFleet(2, tmp_path / "fleet") as fleet:
        run = fleet.run(tmp_path / "app", timeout=600)
        assert run.completed and run.status == "finished:completed", (run, fleet.logs()[-4000:])
        assert "rafl: 2 rounds" in run.stdout, (run.stdout + run.stderr + fleet.logs())[-4000:]
        pids = [p.pid for p in fleet.procs]
    for i in range(2):  # the warm query reported the run; the warm process built it before round 1
        assert "later messages start with it" in (tmp_path / "fleet" / f"superexec{i}.log").read_text()
        got = [line.split("Receiving: ")[1].split(" message")[0]
               for line in (tmp_path / "fleet" / f"node{i}.log").read_text().splitlines() if "Receiving: " in line]
        assert got[:4] == ["query", "query", "query", "train"], got  # node config, warm, ready, then round 1
    for pid in pids:  # stopped, with their process groups
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    run_dir = tmp_path / "runs" / "deployed"
    assert _rows(run_dir) == _rows(in_process)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"] == json.loads((in_process / "summary.json").read_text())["final"]
    import yaml

    assert summary["backend"] == "flower-superlink"  # and rafl federate --resume refuses it (the states are below)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["engine"]["backend"] == "flower"
    states = sorted(p.name for p in (tmp_path / "fleet" / "node-states").rglob("*.st"))  # the nodes' own disk
    assert states == ["0000000.r00002.st", "0000001.r00002.st", "0000002.r00002.st"]
    (folder,) = {p.parent.name for p in (tmp_path / "fleet" / "node-states").rglob("*.st")}
    assert f"the nodes keep its client states in <state-dir>/{folder}/" in run.stdout  # which folder to delete
    # the README's resume with more rounds, on a fresh fleet whose nodes keep the same state-dir
    # (the nodes' state folder was keyed by the config with engine.rounds, so round 3 found no state);
    # its nodes run Flower's own SuperExec (a flwr-clientapp process per message), the first fleet
    # rafl's forking one: both compute the in-process numbers
    with flower_fleet.LocalFleet(2, tmp_path / "fleet2", state_dir=tmp_path / "fleet" / "node-states",
                           isolation="subprocess") as fleet:
        run = fleet.run(tmp_path / "app", timeout=600, run_config=f"resume='{run_dir}' rounds=3")
        assert run.completed, (run, fleet.logs()[-4000:])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["engine"]["rounds"] == 3
    shutil.copytree(in_process, tmp_path / "ref3")
    _federate(["--resume", str(tmp_path / "ref3"), "--set", "engine.rounds=3"])
    assert _rows(run_dir) == _rows(tmp_path / "ref3") and len(_rows(run_dir)) == 3


@pytest.mark.slow
@pytest.mark.integration  # Ray, or a SuperLink with SuperNodes
def test_a_client_failure_in_round_1_on_a_superlink_leaves_no_run_dir(tmp_path):
    """As in-process: a run whose round 1 fails (a client's local training diverges) leaves no
    half-made run dir behind on the ServerApp's side (it left config.yaml and clients.json, which
    `--resume` refused). (A NaN upload no longer stops a run: it is rejected and counted.)"""
    cfg = tmp_path / "div.yaml"
    cfg.write_text("name: div\ndata: {limit_per_class: 10}\npartition: {public_fraction: 0.3}\n"
                   "clients: {n: 2, models: cnn3-small, feature_dim: 16}\n"
                   "algorithm: {name: fedproto, lr: 1.0e+12}\nengine: {rounds: 1, round_timeout_s: 300}\n")
    flower_app.write_app(tmp_path / "app", config=cfg, out=tmp_path / "runs")
    with flower_fleet.LocalFleet(1, tmp_path / "fleet") as fleet:
        run = fleet.run(tmp_path / "app", timeout=600)
    assert run.status == "finished:failed", (run, fleet.logs()[-3000:])
    assert "client 0 (model cnn3-small) on node " in run.status_details  # the node, as in-process the client
    assert "(partition-id=0): algorithm.lr: local training diverged" in run.status_details
    assert not (tmp_path / "runs" / "div").exists(), list((tmp_path / "runs").rglob("*"))
    # the node had written client 0's round-1 state; the server asked it to delete the run's folder
    # and waited for its confirmation before the run ended (no race with the node's cleanup)
    assert "the nodes deleted its client states" in run.stdout, (run.stdout + fleet.logs())[-3000:]
    assert list((tmp_path / "fleet" / "node-states").iterdir()) == [], fleet.logs()[-2000:]


@pytest.mark.slow
@pytest.mark.integration  # Ray, or a SuperLink with SuperNodes
def test_a_failed_serverapp_is_reported_as_failed_although_flwr_run_exits_0(tmp_path, monkeypatch):
    """`flwr run` exits 0 when the ServerApp raises (Flower 1.42); LocalFleet.run reads the run's
    status from the SuperLink instead: finished:failed, with rafl's one-line error as the details.
    The venv is not on PATH (not activated): the SuperLink and SuperNode find the programs they
    start beside this Python."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"name: bad\nsupernet: {{path: {tmp_path / 'missing'}}}\nclients: {{n: 2}}\n")
    flower_app.write_app(tmp_path / "app", config=cfg, out=tmp_path / "runs")
    with flower_fleet.LocalFleet(1, tmp_path / "fleet") as fleet:
        run = fleet.run(tmp_path / "app", timeout=300)
        below = fleet._descendants()  # SuperExecs, and a failed run's ServerApp if it lingers
    assert below and not [pid for pid in below if flower_fleet._alive(pid)]  # stopped, in their own groups too
    assert run.returncode == 0 and run.run_id is not None  # Flower's exit status says nothing
    assert not run.completed and run.status == "finished:failed", run
    assert f"{tmp_path / 'missing'}: no such file" in run.status_details, run.status_details
    assert f"error: {tmp_path / 'missing'}: no such file" in run.stdout  # the ServerApp's log, streamed
    assert not (tmp_path / "runs" / "bad").exists()


@pytest.mark.slow
@pytest.mark.integration  # Ray, or a SuperLink with SuperNodes
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupting_the_simulation_backend_exits_promptly_and_resumes(tmp_path, supernet_dir, sig):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) or SIGTERM (to the driver
    alone, as `kill` or a batch scheduler sends it) while Flower's Simulation Runtime has ClientApps
    in progress: the process exits 128 + the signal (130 / 143) with no traceback
    (Ctrl-C used to hang forever at exit, Flower's worker threads waiting in ray.get after
    ray.shutdown(); SIGTERM used to abort with 134 in Ray's failure-signal handler), the last
    complete round stays checkpointed and --resume finishes the run."""
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "runs" / "int"
    sets = ["supernet.path=" + str(supernet_dir), "data.limit_per_class=10", "clients.n=2", "engine.rounds=200",
            "algorithm.name=fedgh", "algorithm.local_epochs=40", "engine.backend=flower",  # ~1 s client steps
            "clients.arch=r16_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3"]  # no search
    cmd = [sys.executable, "-m", "rafl", "federate", "--no-progress", "--out", str(tmp_path / "runs"), "--set",
           "name=int", *[a for s in sets for a in ("--set", s)]]
    # SIGINT at its default in the child, so Python turns it into KeyboardInterrupt: a shell without job
    # control starts background jobs (`pytest &`) with SIGINT ignored, and children inherit that
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline and not (
                metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.3)  # round 2's ClientApps are running (the ray.get calls Flower's threads wait in)
        signum = getattr(signal, sig)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        try:  # a bound for "hung forever", not a measure of speed (a loaded machine may take long)
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rafl federate did not exit within 180 s of {sig}")
    finally:
        try:  # whatever is left of the run (a hung driver, Ray's processes)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "ActorDiedError" not in err, err[-3000:]
    assert "interrupted: " in err and "received at time" not in err, err[-3000:]  # no stack dump of Ray's
    assert "Aborted!" not in err, err[-3000:]  # rafl's own line says what happened; not click's as well
    done = len(metrics.read_text().splitlines())
    assert done >= 1 and (run_dir / "checkpoint.safetensors").is_file()
    _federate(["--resume", str(run_dir), "--set", f"engine.rounds={done + 1}"])  # in this process, on Flower
    assert [r["round"] for r in _rows(run_dir)] == list(range(1, done + 2))
    from flwr.server.superlink.fleet.vce.backend import raybackend

    assert raybackend.RayBackend.__module__ == raybackend.__name__  # simulate() put Flower's backend back


class HostileGrid(DirectGrid):
    """A :class:`DirectGrid` whose replies are tampered with on the way back, as a hostile node
    would: round 1 client 1's blob grows a huge extra tensor, round 2 client 2 sends NaN and
    client 0 claims 10**12 samples."""

    def answer(self, m):
        reply = super().answer(m)
        if m.metadata.message_type != "train" or not isinstance(reply, flwr_app.Message):
            return reply
        content, rnd = reply.content, int(m.metadata.group_id)
        for cid in (0, 1, 2):
            slot = f".{cid}"
            if flower_wire.PAYLOAD + slot not in content.array_records:
                continue
            up = flower_wire.records_to_payload(content, "test", slot)
            if (rnd, cid) == (1, 1):
                n = sum(t.numel() for t in up.tensors.values())
                up.tensors["junk"] = torch.zeros(2 * n + 300_000)
            elif (rnd, cid) == (2, 2):
                up.tensors = {k: v * float("nan") if v.is_floating_point() else v for k, v in up.tensors.items()}
            elif (rnd, cid) == (2, 0):
                up.meta["n_samples"] = 10**12
            else:
                continue
            content.array_records[flower_wire.PAYLOAD + slot] = flower_wire.payload_to_records(up, slot)[flower_wire.PAYLOAD + slot]
        return reply


@pytest.mark.slow
def test_hostile_uploads_on_flower_are_rejected_counted_and_the_rounds_complete(tmp_path, supernet_dir, task_identity):
    """On Flower as in-process: an oversized blob is refused before it is parsed, a NaN upload is
    rejected, a 10**12-sample claim weighs the registered count; each rejection names the client
    and its node, and every round completes with the others."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    sets = [f"supernet.path={supernet_dir}", "data.limit_per_class=10", "clients.n=3", "engine.rounds=2",
            "algorithm.name=fedavg", "clients.arch=r16_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3"]
    prep = federate.prepare(load_run_config(None, sets), progress=False)
    summary = flower_app.run_on_grid(HostileGrid(2), prep, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rejected"] for r in rows] == [1, 1] and summary["rejected_uploads"] == 2
    assert not any(r.get("round_failed") for r in rows)
    big, nan = rows[0]["rejected_reasons"]["1"], rows[1]["rejected_reasons"]["2"]
    assert "payload from client 1 (model " in big and "on node 2 (partition-id=1)" in big, big
    assert "bytes; allowed: at most" in big and "(engine.max_upload_mb)" in big, big
    assert "payload from client 2" in nan and "NaN or Inf" in nan, nan
    assert rows[1]["n_samples_overridden"] == [0]
