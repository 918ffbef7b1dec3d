"""Client steps in worker processes (``engine.workers``) and the shared evaluation of clients that
have not trained: the same metrics and states for 1 and 2 workers, a dead worker fails only its
client, Ctrl-C stops the workers and ``--resume`` repeats the round, one evaluation per model for
the untrained clients."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest
import torch

from rafl.data import load_dataset, make_partition
from rafl.errors import UserInputError
from rafl.federation.algorithms import get_algorithm
from rafl.federation.build import build_federation, build_group_federation
from rafl.federation.engine import Engine, EngineConfig
from rafl.federation.runners import PooledLoader
from rafl.federation.store import load_state
from rafl.federation.workers import resolve_workers
from rafl.reports.run import RunReport
from rafl.supernet import SearchSpace, build_supernet

TIME_KEYS = ("time_s", "time_client_update_s", "time_aggregate_s", "time_evaluate_s", "time_engine_s")
MEMBERS = ["cnn4-small", "cnn3-small"]


@pytest.fixture(scope="module")
def digits():
    ds = load_dataset("digits", limit_per_class=12)
    part = make_partition(ds.labels.numpy(), "pathological", 8, 0, k=2, public_fraction=0.0)
    return ds, part


def _group(digits, name="fedproto", **hp):
    ds, part = digits
    algo = get_algorithm(name)(**{"local_epochs": 1, "lr": 0.01, **hp})
    fed, _ = build_group_federation(ds, part, MEMBERS, algo, feature_dim=16, batch_size=8)
    return fed


def _history(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _states(run_dir):
    return {p.name: load_state(p) for p in sorted((run_dir / "clients").iterdir())}


def _same_states(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        wa, wb = a[name]["model"], b[name]["model"]
        assert list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), name


def test_one_and_two_workers_give_the_same_metrics_and_states(digits, tmp_path):
    # partial participation and dropout: some rounds evaluate untrained clients (shared evaluation)
    cfg = dict(rounds=3, clients_per_round=3, dropout=0.25, seed=2)
    runs = {}
    for w in (1, 2):
        summary = Engine(_group(digits), EngineConfig(**cfg, workers=w), tmp_path / f"w{w}", progress=False,
                         observers=[RunReport(tmp_path / f"w{w}")]).run()
        runs[w] = (summary, _history(tmp_path / f"w{w}"), _states(tmp_path / f"w{w}"))
    (s1, h1, st1), (s2, h2, st2) = runs[1], runs[2]
    assert h1 == h2 and s1["final"] == s2["final"] and s1["clients"] == s2["clients"]
    assert any("eval.untrained_clients" in r for r in h1)  # the shared evaluation ran in both
    assert sum(r["failed"] for r in h1) > 0
    _same_states(st1, st2)


def test_uint8_images_kept_as_loaded_give_the_same_metrics_and_states(tmp_path):
    """A dataset built from uint8 (N, H, W, C) pixels keeps them as loaded (a channels-last (N, C,
    H, W) view, no second copy); batches and a whole federated run are the same bit for bit as
    with a contiguous (N, C, H, W) copy of the pixels."""
    import dataclasses

    import numpy as np

    from rafl.data.datasets import Images, from_uint8

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 12)
    nhwc = rng.integers(0, 256, size=(len(labels), 16, 16, 3), dtype=np.uint8)
    nhwc[np.arange(len(labels)), :, :, labels % 3] //= 2  # a little class signal
    ds = from_uint8("cifar10", nhwc, labels, np.array(["train"] * len(labels)), list("abcd"), 16)
    assert ds.images.pixels.data_ptr() == torch.from_numpy(nhwc).data_ptr()  # no copy of the dataset
    copy = dataclasses.replace(ds, images=Images(ds.images.pixels.contiguous(), ds.mean, ds.std))
    idx = torch.tensor([5, 0, 47, 12])
    batch = ds.images[idx]
    assert batch.is_contiguous() and torch.equal(batch, copy.images[idx])
    part = make_partition(labels, "pathological", 4, 0, k=2, public_fraction=0.0)
    runs = {}
    for name, data in (("view", ds), ("copy", copy)):
        algo = get_algorithm("fedproto")(local_epochs=1, lr=0.01)
        fed, _ = build_group_federation(data, part, MEMBERS, algo, feature_dim=16, batch_size=8)
        Engine(fed, EngineConfig(rounds=2, seed=1, workers=1), tmp_path / name, progress=False,
               observers=[RunReport(tmp_path / name)]).run()
        runs[name] = (_history(tmp_path / name), _states(tmp_path / name))
    assert runs["view"][0] == runs["copy"][0] and "model.acc_mean_over_clients" in runs["view"][0][-1]
    _same_states(runs["view"][1], runs["copy"][1])


@pytest.mark.slow
def test_one_and_two_workers_agree_on_supernet_subnets(tmp_path):
    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    supernet = build_supernet(space).eval()
    ds = load_dataset("digits", limit_per_class=10)
    part = make_partition(ds.labels.numpy(), "dirichlet", 3, 0, alpha=1.0, min_samples=5, public_fraction=0.2)
    archs = [space.smallest(), space.middle(), space.smallest()]
    hist, states = [], []
    for w in (1, 2):
        fed, _ = build_federation(ds, part, supernet, archs, get_algorithm("rafl")(local_epochs=1), batch_size=16,
                                  count_macs=False)
        Engine(fed, EngineConfig(rounds=2, seed=1, workers=w), tmp_path / f"w{w}", progress=False,
               observers=[RunReport(tmp_path / f"w{w}")]).run()
        hist.append(_history(tmp_path / f"w{w}"))
        states.append(_states(tmp_path / f"w{w}"))
    assert hist[0] == hist[1]
    for name in states[0]:
        for part_name in ("local",):
            a, b = states[0][name][part_name], states[1][name][part_name]
            assert all(torch.equal(a[k], b[k]) for k in a)


class _DyingInWorker(get_algorithm("fedproto")):
    """FedProto whose client 3 kills its worker process in round 2 (never the run's process)."""

    main_pid = os.getpid()

    def client_update(self, state, broadcast, client):
        if client.round == 2 and client.client_id == 3 and os.getpid() != self.main_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().client_update(state, broadcast, client)


@pytest.mark.slow
def test_a_worker_that_dies_fails_its_client_and_the_run_goes_on(digits, tmp_path):
    ds, part = digits
    fed, _ = build_group_federation(ds, part, MEMBERS, _DyingInWorker(local_epochs=1, lr=0.01), feature_dim=16,
                                    batch_size=8)
    summary = Engine(fed, EngineConfig(rounds=3, seed=0, workers=2), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    hist = _history(tmp_path)
    assert [r["failed"] for r in hist] == [0, 1, 0] and summary["failures"] == 1
    assert "3" in hist[1]["lost"] and "worker process died" in hist[1]["lost"]["3"]
    assert hist[1]["participated"] == 7 and hist[2]["participated"] == 8
    assert not multiprocessing.active_children()  # every worker was stopped at the end


class _InterruptedFromWorker(get_algorithm("fedproto")):
    """FedProto whose client 5 presses Ctrl-C (SIGINT to the run's process) in round 3."""

    main_pid = os.getpid()

    def client_update(self, state, broadcast, client):
        if client.round == 3 and client.client_id == 5:
            assert os.getpid() != self.main_pid, "client steps in this process: nothing to interrupt from"
            os.kill(self.main_pid, signal.SIGINT)
        return super().client_update(state, broadcast, client)


@pytest.fixture
def default_sigint():
    """Python's own Ctrl-C handler during the test, as in a fresh ``rafl federate``: earlier tests of
    the session (Flower's runtime) install SIGINT handlers of their own, which a run leaves alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_ctrl_c_stops_the_workers_and_resume_gives_the_same_metrics(digits, tmp_path, default_sigint):
    ds, part = digits
    # seed 6: client 5 is sampled in round 3 and survives the dropout draw (it presses Ctrl-C)
    cfg = EngineConfig(rounds=4, clients_per_round=6, dropout=0.1, seed=6, workers=2)
    ref = Engine(_group(digits), cfg, tmp_path / "a", progress=False, observers=[RunReport(tmp_path / "a")]).run()
    fed, _ = build_group_federation(ds, part, MEMBERS, _InterruptedFromWorker(local_epochs=1, lr=0.01),
                                    feature_dim=16, batch_size=8)
    with pytest.raises(KeyboardInterrupt):
        Engine(fed, cfg, tmp_path / "b", progress=False, observers=[RunReport(tmp_path / "b")]).run()
    assert not multiprocessing.active_children()
    assert [r["round"] for r in _history(tmp_path / "b")] == [1, 2]
    resumed = Engine(_group(digits), cfg, tmp_path / "b", progress=False,
                     observers=[RunReport(tmp_path / "b")]).run(resume=True)
    assert _history(tmp_path / "b") == _history(tmp_path / "a") and resumed["final"] == ref["final"]
    assert not [p.name for p in (tmp_path / "b" / "clients").iterdir() if p.name.endswith(".tmp")]
    _same_states(_states(tmp_path / "a"), _states(tmp_path / "b"))


class _DivergingClient(get_algorithm("fedproto")):
    def client_update(self, state, broadcast, client):
        if client.client_id in self.diverging:
            raise UserInputError(f"local training diverged (loss {'nan' if client.client_id == 2 else 'inf'})",
                                 field="algorithm.lr")
        return super().client_update(state, broadcast, client)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_method_error_is_that_clients_failure_and_the_run_goes_on(digits, tmp_path, workers):
    """Client 2's step raises a UserInputError in every round (in this process, or in a worker): it
    is left out of each round with its reason in ``rejected_reasons``, its state is never committed,
    and the run completes with the other clients, on both runners alike."""
    ds, part = digits
    algo = _DivergingClient(local_epochs=1, lr=0.01)
    algo.diverging = {2}
    fed, _ = build_group_federation(ds, part, MEMBERS, algo, feature_dim=16, batch_size=8)
    summary = Engine(fed, EngineConfig(rounds=2, seed=0, workers=workers), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    rows = _history(tmp_path)
    assert summary["failed_rounds"] == 0 and summary["rejected_uploads"] == 2
    for row in rows:
        assert row["rejected"] == 1 and row["rejected_reasons"] == {
            "2": "client 2 (model cnn4-small): its client step failed: algorithm.lr: local training diverged (loss nan)"}
    assert not any(p.name.startswith("0000002.") for p in (tmp_path / "clients").iterdir())
    assert not multiprocessing.active_children()


def test_a_method_error_of_every_client_stops_the_run_with_the_first_in_job_order(digits, tmp_path):
    """When fewer than engine.min_valid_uploads clients remain without an error (here: every
    client's step raises), the error is the run's: the first client in job order, as in-process."""
    ds, part = digits
    algo = _DivergingClient(local_epochs=1, lr=0.01)
    algo.diverging = set(range(len(part.clients)))
    fed, _ = build_group_federation(ds, part, MEMBERS, algo, feature_dim=16, batch_size=8)
    with pytest.raises(UserInputError, match=r"^client 0 \(model cnn4-small\): algorithm.lr: local training diverged "
                                             r"\(loss inf\)$"):
        Engine(fed, EngineConfig(rounds=1, seed=0, workers=2), tmp_path / "run", progress=False,
               observers=[RunReport(tmp_path / "run")]).run()
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists() and not multiprocessing.active_children()


class _CountingEvaluations(get_algorithm("fedproto")):
    calls: list[int] = []

    def evaluate(self, state, client):
        type(self).calls.append(len(client.test_loader.dataset))
        return super().evaluate(state, client)


def test_untrained_clients_share_one_evaluation_per_model(digits, tmp_path):
    ds, part = digits
    _CountingEvaluations.calls = []
    algo = _CountingEvaluations(local_epochs=1, lr=0.01)
    fed, _ = build_group_federation(ds, part, MEMBERS, algo, feature_dim=16, batch_size=8)
    engine = Engine(fed, EngineConfig(rounds=1, clients_per_round=2, seed=3, workers=1), tmp_path, progress=False,
                    observers=[RunReport(tmp_path)])
    summary = engine.run()
    row = _history(tmp_path)[0]
    trained = sorted(engine.store.committed)
    untrained = [c for c in range(8) if c not in trained]
    # 2 trained clients one by one + one evaluation per model of the untrained ones
    n_models = len({fed.clients[c].model_key for c in untrained})
    assert len(_CountingEvaluations.calls) == 2 + n_models
    assert sum(_CountingEvaluations.calls[2:]) == sum(len(part.clients[c].test) for c in untrained)
    assert row["eval.trained_clients"] == 2 and row["eval.untrained_clients"] == 6
    # the pooled figure: the initial model of each model's first untrained client, on every
    # untrained client's test split; the same counts as evaluating them one by one with it
    from rafl.federation.runners import client_context, evaluate_client

    correct = total = 0.0
    for c in untrained:
        rep = min(u for u in untrained if fed.clients[u].model_key == fed.clients[c].model_key)
        ctx = client_context(fed, 3, rep, 1)
        ctx.test_loader = fed.loaders(c, "test", 0)
        counts = evaluate_client(fed, engine.store, ctx, _broadcast(tmp_path))
        correct, total = correct + counts["proto.correct"], total + counts["proto.total"]
    assert row["proto.acc_untrained_sample_weighted"] == pytest.approx(correct / total)
    assert sorted(summary["clients"]) == [str(c) for c in trained]
    assert "2 clients that have trained" in " ".join(summary["eval_coverage"].values())
    assert "6 clients that have not trained" in " ".join(summary["eval_coverage"].values())


def _broadcast(run_dir):
    from rafl.federation.payload import Payload

    ck = load_state(run_dir / "checkpoint.safetensors")
    return Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"]))


def test_fedgh_evaluates_untrained_clients_one_by_one(digits, tmp_path):
    # FedGH's evaluation applies each client's own label prior: no shared evaluation
    Engine(_group(digits, "fedgh"), EngineConfig(rounds=1, clients_per_round=2, seed=0, workers=1), tmp_path,
           progress=False, observers=[RunReport(tmp_path)]).run()
    row = _history(tmp_path)[0]
    assert "eval.untrained_clients" not in row and "model.acc_mean_over_clients" in row


def test_pooled_loader_joins_batches_in_client_order():
    loaders = [[(torch.full((3, 1), float(i)), torch.full((3,), i))] * 2 for i in range(3)]

    class Sized(list):
        dataset = range(6)

    pooled = PooledLoader([Sized(ld) for ld in loaders], batch_size=5)
    batches = list(pooled)
    assert [len(y) for _, y in batches] == [6, 6, 6] and len(pooled.dataset) == 18
    assert torch.cat([y for _, y in batches]).tolist() == [0] * 6 + [1] * 6 + [2] * 6


def test_workers_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_workers(None, 1, cpu) == 1 and resolve_workers(3, 1, cpu) == 3
    assert 1 <= resolve_workers(None, 2, cpu) <= 2 and resolve_workers(None, 10, cuda) == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UserInputError, match="engine.workers"):
            resolve_workers(bad, 4, cpu)
    with pytest.raises(UserInputError, match="engine.workers.*allowed: 1"):
        resolve_workers(2, 4, cuda)


def test_default_workers_are_the_cores_other_processes_leave_free(monkeypatch, tmp_path):
    """``engine.workers: null``: the usable cores (affinity, cgroup quota) minus the load average's
    other runnable processes (this run's own counted as 1), scaled to this process's share of the
    machine, at least 1 and at most the clients sampled."""
    from rafl.federation import workers as w

    cpu, read_quota = torch.device("cpu"), w._cgroup_cores
    monkeypatch.setattr(w, "cpu_cores", lambda: 4)
    monkeypatch.setattr(w.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(w, "_cgroup_cores", lambda: None)
    for load, expected in ((0.0, 4), (1.0, 4), (1.4, 4), (2.0, 3), (3.0, 2), (4.6, 1), (20.0, 1)):
        monkeypatch.setattr(w.os, "getloadavg", lambda load=load: (load, load, load))
        assert w.available_cores() == expected, load
        assert resolve_workers(None, 10, cpu) == expected and resolve_workers(None, 2, cpu) == min(2, expected)
        assert resolve_workers(3, 10, cpu) == 3  # an explicit count is kept whatever the load
    monkeypatch.setattr(w.os, "cpu_count", lambda: 8)  # 4 of 8 cores usable: half the others' load lands on them
    monkeypatch.setattr(w.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert w.available_cores() == 2
    monkeypatch.setattr(w, "_cgroup_cores", lambda: 1.5)  # a quota of 1.5 cores: 1
    assert w.available_cores() == 1
    for text, cores in (("max 100000\n", None), ("250000 100000\n", 2.5), ("50000 100000\n", 1.0), ("junk", None)):
        (tmp_path / "cpu.max").write_text(text)
        assert read_quota(str(tmp_path / "cpu.max")) == cores
    assert read_quota(str(tmp_path / "missing")) is None


def test_sigterm_while_waiting_for_workers_is_raised_after_the_wait_not_lost():
    """SIGTERM under a Python handler (rafl's CLI raises SystemExit(143)) that arrives while the run
    waits for its workers is held and raised when the wait ends: a handler's exception raised inside
    an at-fork callback or a finalizer would be lost, and the run would go on."""
    from rafl.federation.workers import _interrupt_flag

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(SystemExit) as exc:
            with _interrupt_flag() as interrupted:
                os.kill(os.getpid(), signal.SIGTERM)
                assert list(interrupted) == [signal.SIGTERM]  # held, not raised
        assert exc.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is handler  # restored
    finally:
        signal.signal(signal.SIGTERM, previous)
