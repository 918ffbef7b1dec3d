"""The in-process engine on a tiny real federation (digits subset, width-0.25 OFA supernet).

Sampling/dropout/sporadic determinism, communication counting, resume equivalence after a crash
mid-round, state offloading (only sampled clients materialized), FedAvg rejecting heterogeneous
models, leakage disjointness, metrics files.
"""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest
import torch

from rafl.data import load_dataset, make_partition
from rafl.errors import UserInputError
from rafl.federation.algorithms import get_algorithm
from rafl.federation.algorithms.rafl import RaFL
from rafl.federation.build import build_federation
from rafl.federation.checks import check_disjoint
from rafl.federation.engine import Engine, EngineConfig, sample_clients, sporadic_update
from rafl.reports.run import RunReport
from rafl.seeds import SeedTree
from rafl.supernet import SearchSpace, build_supernet

TIME_KEYS = ("time_s", "time_client_update_s", "time_aggregate_s", "time_evaluate_s", "time_engine_s")


def _no_times(history):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in history]


def _read_history(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sampling_sporadic_dropout_are_seeded():
    rng_a, rng_b = SeedTree(3).sampling_generator(1), SeedTree(3).sampling_generator(1)
    assert sample_clients(list(range(50)), 7, rng_a) == sample_clients(list(range(50)), 7, rng_b)
    avail = list(range(10))
    new = sporadic_update(avail, 40, 0.3, np.random.default_rng(0))
    assert len(new) == 10 and len(set(new) - set(avail)) == 3 and new == sorted(new)
    assert new == sporadic_update(avail, 40, 0.3, np.random.default_rng(0))
    assert SeedTree(1).node(2, 3) != SeedTree(1).node(3, 2)


@pytest.mark.slow
def test_rafl_round_metrics_comm_and_files(tiny, tmp_path):
    space, supernet, ds, part = tiny
    archs = [space.smallest(), space.middle(), space.smallest()]
    fed, table = build_federation(ds, part, supernet, archs, RaFL(), batch_size=16)
    assert [r["arch"] for r in table] == [a.to_string() for a in archs] and table[1]["macs_m"] > table[0]["macs_m"]
    summary = Engine(fed, EngineConfig(rounds=2, seed=1, target_accuracy=0.0), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    hist = _read_history(tmp_path)
    assert [r["round"] for r in hist] == [1, 2]
    # the knowledge network: the smallest subnet narrowed to RaFL's default knowledge_width
    from rafl.supernet.model import narrow_width

    know_bytes = narrow_width(fed.server.make_model(space.smallest()),
                              RaFL().hparams["knowledge_width"]).state_dict()
    raw = sum(v.numel() * v.element_size() for v in know_bytes.values())
    assert raw < 0.4 * sum(v.numel() * v.element_size() for v in fed.server.make_model(space.smallest()).state_dict().values())
    for r in hist:
        # 3 uploads and 3 downloads of the knowledge net (uploads add n_samples); the safetensors
        # header (a JSON entry per tensor, ~100 B each) adds about 25% to this small network
        assert 3 * raw < r["bytes_down"] < r["bytes_up"] < 3 * raw * 1.35
        for m in ("model", "knowledge"):
            for stat in ("acc_mean_over_clients", "acc_sample_weighted", "acc_std_over_clients"):
                assert 0.0 <= r[f"{m}.{stat}"] <= 1.0
    assert hist[1]["cum_bytes_up"] == hist[0]["bytes_up"] + hist[1]["bytes_up"]
    # the sample-weighted accuracy is sum correct / sum samples over the clients
    per = summary["clients"]
    n_test = [per[str(i)]["test_samples"] for i in range(3)]
    acc = [per[str(i)]["model.acc"] for i in range(3)]
    assert hist[-1]["model.acc_sample_weighted"] == pytest.approx(np.dot(acc, n_test) / sum(n_test))
    assert hist[-1]["model.acc_mean_over_clients"] == pytest.approx(np.mean(acc))
    assert summary["co_round"] == 1 and summary["co_mb_to_target"] == pytest.approx(hist[0]["cum_mb"])
    with open(tmp_path / "metrics.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 2
    for f in ("summary.json", "accuracy_vs_round.png", "accuracy_vs_mb.png", "checkpoint.safetensors"):
        assert (tmp_path / f).is_file()
    # only the committed state of each client is on disk
    assert sorted(p.name for p in (tmp_path / "clients").iterdir()) == [f"{i:07d}.r00002.st" for i in range(3)]


class _CrashingRaFL(RaFL):
    """RaFL that dies in round 3 after one client has written its new state."""

    calls = 0

    def client_update(self, state, broadcast, client):
        if client.round == 3:
            type(self).calls += 1
            if type(self).calls == 2:
                raise KeyboardInterrupt("simulated crash")
        return super().client_update(state, broadcast, client)


@pytest.mark.slow
def test_resume_after_crash_gives_the_same_metrics(tiny, tmp_path):
    space, supernet, ds, part = tiny
    archs = [space.smallest(), space.middle(), space.smallest()]
    # in-process (workers=1): the crash is a KeyboardInterrupt in this process (tests/test_workers.py
    # interrupts a run whose clients are in worker processes)
    # seed 6: both clients sampled in round 3 survive the dropout draw (the crash needs a second client)
    cfg = EngineConfig(rounds=3, clients_per_round=2, dropout=0.2, eval_every=2, seed=6, workers=1)
    fed, _ = build_federation(ds, part, supernet, archs, RaFL(), batch_size=16, count_macs=False)
    ref = Engine(fed, cfg, tmp_path / "a", progress=False, observers=[RunReport(tmp_path / "a")]).run()
    fed_c, _ = build_federation(ds, part, supernet, archs, _CrashingRaFL(), batch_size=16, count_macs=False)
    with pytest.raises(KeyboardInterrupt):
        Engine(fed_c, cfg, tmp_path / "b", progress=False, observers=[RunReport(tmp_path / "b")]).run()
    assert [r["round"] for r in _read_history(tmp_path / "b")] == [1, 2]
    fed_r, _ = build_federation(ds, part, supernet, archs, RaFL(), batch_size=16, count_macs=False)
    resumed = Engine(fed_r, cfg, tmp_path / "b", progress=False, observers=[RunReport(tmp_path / "b")]).run(resume=True)
    assert _no_times(_read_history(tmp_path / "b")) == _no_times(_read_history(tmp_path / "a"))
    assert resumed["final"] == ref["final"] and resumed["cum_bytes_up"] == ref["cum_bytes_up"]
    assert resumed["failures"] == ref["failures"]


def test_only_sampled_clients_are_materialized(tmp_path):
    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    supernet = build_supernet(space).eval()
    ds = load_dataset("digits", limit_per_class=40)
    part = make_partition(ds.labels.numpy(), "iid", 100, 0, public_fraction=0.1)

    class Counting(get_algorithm("standalone")):
        inits = 0

        def init_client(self, client):
            type(self).inits += 1
            return super().init_client(client)

    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 100, Counting(local_epochs=1),
                              batch_size=8, count_macs=False)
    cfg = EngineConfig(rounds=2, clients_per_round=3, sporadic_rate=0.5, available=10, dropout=0.0,
                       eval_clients="sampled", seed=0, workers=1)  # in-process: Counting counts here
    engine = Engine(fed, cfg, tmp_path, progress=False, observers=[RunReport(tmp_path)])
    engine.run()
    on_disk = sorted(int(p.name.split(".")[0]) for p in (tmp_path / "clients").iterdir())
    hist = _read_history(tmp_path)
    assert len(on_disk) <= 6 and Counting.inits <= 6  # never the 100 clients
    assert sum(r["sampled"] for r in hist) == 6 and len(engine.store.committed) == len(on_disk)


def test_dropout_counts_failures_and_round_completes(tiny, tmp_path):
    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, get_algorithm("fedavg")(),
                              batch_size=16, count_macs=False)
    s = Engine(fed, EngineConfig(rounds=3, dropout=0.5, eval_every=3, seed=2), tmp_path, progress=False,
               observers=[RunReport(tmp_path)]).run()
    hist = _read_history(tmp_path)
    assert s["failures"] == sum(r["failed"] for r in hist) > 0
    for r in hist:  # failed clients download but never upload
        assert r["participated"] == r["sampled"] - r["failed"]
        per_model = r["bytes_down"] / r["sampled"]
        assert r["bytes_up"] == pytest.approx(per_model * r["participated"], rel=0.01)


def test_fedavg_family_rejects_heterogeneous_models(tiny, tmp_path):
    space, supernet, ds, part = tiny
    for name in ("fedavg", "fedprox", "fednova"):
        with pytest.raises(UserInputError, match="needs identical client models"):
            build_federation(ds, part, supernet, [space.smallest(), space.largest(), space.smallest()],
                             get_algorithm(name)(), count_macs=False)
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, get_algorithm("fednova")(),
                              batch_size=16, count_macs=False)
    s = Engine(fed, EngineConfig(rounds=1, seed=0), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    assert 0.0 <= s["final"]["model.acc_mean_over_clients"] <= 1.0


def test_invalid_upload_is_rejected_naming_client(tiny, tmp_path):
    space, supernet, ds, part = tiny

    class NaNRaFL(RaFL):
        def client_update(self, state, broadcast, client):
            state, up = super().client_update(state, broadcast, client)
            key = next(iter(up.tensors))
            up.tensors[key] = up.tensors[key] * float("nan")
            return state, up

    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, NaNRaFL(), batch_size=16, count_macs=False)
    s = Engine(fed, EngineConfig(rounds=1), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    row = _read_history(tmp_path)[0]
    assert row["rejected"] == 3 and row["round_failed"] is True and s["rejected_uploads"] == 3
    assert s["failed_rounds"] == 1
    assert re.match(r"payload from client 0.*NaN or Inf values \(the client.s local training diverged\); allowed: a "
                    r"smaller algorithm.lr", row["rejected_reasons"]["0"]), row["rejected_reasons"]


def test_partition_indices_are_disjoint_from_public_pool(tiny):
    _, _, ds, part = tiny
    check_disjoint(part)  # public pool, and every client's train/val/test, pairwise disjoint
    sets = [set(part.public.tolist())] + [set(getattr(c, s).tolist()) for c in part.clients
                                          for s in ("train", "val", "test")]
    assert sum(len(s) for s in sets) == len(set().union(*sets))
    bad = type(part)(clients=[part.clients[0], part.clients[0]], public=part.public, meta=part.meta)
    with pytest.raises(UserInputError, match="leakage"):
        check_disjoint(bad)


@pytest.mark.parametrize("name", ["rafl", "feddf"])
def test_server_distillation_runs_a_round(name, tiny, tmp_path):
    """RaFL with Eqs. 8-9 and FedDF distil on the server's public pool (distill_kl) for real."""
    space, supernet, ds, part = tiny
    assert len(part.public) > 0
    archs = [space.smallest(), space.middle(), space.smallest()]
    hp = {"distill": True, "distill_epochs": 1} if name == "rafl" else {"distill_epochs": 1}
    fed, _ = build_federation(ds, part, supernet, archs, get_algorithm(name)(**hp), batch_size=16)
    Engine(fed, EngineConfig(rounds=1, seed=0), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    last = _read_history(tmp_path)[-1]
    assert last["participated"] == 3 and np.isfinite(last["model.acc_mean_over_clients"])


def test_fednova_server_step_is_tau_eff_times_the_weighted_normalized_update(tiny):
    """FedNova (Wang et al. 2020, Eq. 7 / Sec. 4): x <- x - tau_eff * sum_i p_i d_i with d_i the update
    normalized by ||a_i||_1 and tau_eff = sum_i p_i ||a_i||_1; ||a||_1 of momentum SGD in closed form."""
    from rafl.federation.algorithms.fedavg import _a_norm
    from rafl.federation.payload import Payload

    rho, tau = 0.9, 5
    assert _a_norm(tau, rho) == pytest.approx(sum((1 - rho ** (tau - j)) / (1 - rho) for j in range(tau)))
    assert _a_norm(tau, 0.0) == tau and _a_norm(0, rho) == 0.0
    space, supernet, ds, part = tiny
    algo = get_algorithm("fednova")()
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, algo, batch_size=16, count_macs=False)
    state, _ = algo.init_server(fed.server)
    old = state["global"]
    params = {k for k, _ in fed.server.make_model(client_id=0).named_parameters()}
    g = torch.Generator().manual_seed(0)
    d = [{k: (torch.randn(v.shape, generator=g) if k in params else v.clone()) for k, v in old.items()} for _ in range(2)]
    ups = [Payload(d[0], {"n_samples": 1, "tau": 2, "a_norm": 2.0, "client_id": 0}),
           Payload(d[1], {"n_samples": 3, "tau": 4, "a_norm": 4.0, "client_id": 1})]
    new, _ = algo.server_aggregate(ups, state, fed.server)
    tau_eff = 0.25 * 2.0 + 0.75 * 4.0
    for k in params:
        want = old[k].float() - tau_eff * (0.25 * d[0][k] + 0.75 * d[1][k])
        assert torch.allclose(new["global"][k].float(), want, atol=1e-5), k
    # an upload without local steps (a_norm 0) does not count
    skip = Payload({k: v * 100 for k, v in d[0].items()}, {"n_samples": 100, "tau": 0, "a_norm": 0.0, "client_id": 2})
    again, _ = algo.server_aggregate([*ups, skip], state, fed.server)
    assert all(torch.equal(again["global"][k], new["global"][k]) for k in params)

