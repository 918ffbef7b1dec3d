"""Hostile uploads: the server screens every upload (size before parsing, dtypes, finite values in
range, shapes) and weighs only by the registered sample counts; robust aggregation rules.

Every hostile class of the reliability issue is tried on FedAvg's real server state (a small
linear model): each is rejected with the client and a reason, or accepted with no effect (a
claimed sample count). Two runs of the engine on a tiny digits federation check the round
completes with the others, ``engine.min_valid_uploads`` and that a 10**12-sample claim changes
nothing.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from rafl.errors import UserInputError
from rafl.federation.aggregation import AggregationRule, payload_weights, robust_average, weighted_average
from rafl.federation.algorithms.base import ClientInfo, ServerContext
from rafl.federation.algorithms.fedavg import FedAvg
from rafl.federation.algorithms.fedproto import FedProto
from rafl.federation.payload import Payload
from rafl.federation.screening import UploadPolicy, screen_uploads
from rafl.federation.store import load_state
from rafl.reports.run import RunReport


class _Split(nn.Module):
    """features (B, 6) -> (B, 4), head (B, 4) -> (B, 3), with BatchNorm (an int64 buffer)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 3)
        self.feature_dim = 4

    def forward(self, x):
        return self.head(self.features(x))


CLIENTS = [ClientInfo(i, "custom", None, "split", n) for i, n in enumerate((40, 50, 60))]


def _server() -> ServerContext:
    torch.manual_seed(0)
    return ServerContext(clients=CLIENTS, make_model=lambda arch=None, client_id=0: _Split(), public_images=None,
                         n_classes=3)


def _honest(state, cid, shift=0.0):
    return Payload({k: (v + shift if v.is_floating_point() else v.clone()) for k, v in state.items()},
                   {"n_samples": CLIENTS[cid].n_samples})


def _screen(algo, state, uploads, policy=UploadPolicy()):
    spec = {c: algo.upload_spec(state, CLIENTS[c]) for c, _ in uploads}
    limits = {c: policy.byte_limit(spec[c]) for c, _ in uploads}
    return screen_uploads(uploads, algo, state, CLIENTS, 3, policy, limits=limits, sender=lambda c: f"client {c}")


def _hostile(g):
    """name -> a function of the global state giving client 1's hostile upload."""
    first = next(iter(g))
    return {
        "float64 tensor": lambda: Payload({**g, first: g[first].double()}, {"n_samples": 50}),
        "float16 tensor": lambda: Payload({**g, first: g[first].half()}, {"n_samples": 50}),
        "bool tensor": lambda: Payload({**g, first: g[first] > 0}, {"n_samples": 50}),
        "complex NaN tensor": lambda: Payload({**g, first: torch.full(g[first].shape, complex(math.nan, 0))}),
        "int64 of 2**40": lambda: Payload({**g, "features.1.num_batches_tracked": torch.tensor(2**40)}),
        "negative int64": lambda: Payload({**g, "features.1.num_batches_tracked": torch.tensor(-1)}),
        "all 3e38": lambda: Payload({k: torch.full_like(v, 3e38) if v.is_floating_point() else v for k, v in g.items()}),
        "NaN": lambda: Payload({**g, first: g[first] * math.nan}),
        "Inf": lambda: Payload({**g, first: g[first] + math.inf}),
        "missing tensor": lambda: Payload({k: v for k, v in g.items() if k != first}),
        "wrong shape": lambda: Payload({**g, first: torch.zeros(2, 2)}),
        "extra 8 MB tensor": lambda: Payload({**g, "junk": torch.zeros(2_000_000)}),
        "4 MB metadata string": lambda: Payload(dict(g), {"note": "x" * 4_000_000}),
        "n_samples 10**400": lambda: Payload(dict(g), {"n_samples": 10**400}),
        "n_samples NaN": lambda: Payload(dict(g), {"n_samples": math.nan}),
    }


@pytest.mark.parametrize("case", sorted(_hostile({"a": torch.zeros(1)})))
def test_every_hostile_upload_class_is_rejected_with_the_client_and_the_reason(case):
    algo, server = FedAvg(), _server()
    state, _ = algo.init_server(server)
    g = state["global"]
    uploads = [(0, _honest(g, 0)), (1, _hostile(g)[case]()), (2, _honest(g, 2))]
    out = _screen(algo, state, uploads)
    assert list(out.rejected) == [1] and out.accepted_ids == [0, 2], (case, out.rejected)
    assert out.rejected[1].startswith("payload from client 1"), out.rejected[1]
    # the others aggregate as if client 1 had not uploaded
    new, _ = algo.server_aggregate(out.accepted, state, server)
    assert all(torch.isfinite(v).all() for v in new["global"].values() if v.is_floating_point())


def test_the_reasons_name_what_is_allowed():
    algo, server = FedAvg(), _server()
    state, _ = algo.init_server(server)
    reasons = {case: _screen(algo, state, [(1, make())]).rejected[1] for case, make in _hostile(state["global"]).items()}
    assert "float64 tensor; allowed: float32, int32, int64" in reasons["float64 tensor"]
    assert "complex64 tensor" in reasons["complex NaN tensor"]
    assert "allowed: 0..2147483647" in reasons["int64 of 2**40"]
    assert "magnitude 3e+38; allowed: |x| <= 1e+06 (engine.max_abs_value)" in reasons["all 3e38"]
    assert "(engine.max_upload_mb)" in reasons["extra 8 MB tensor"] and "(engine.max_upload_mb)" in reasons[
        "4 MB metadata string"]
    assert "meta.n_samples: is NaN or Inf" in reasons["n_samples NaN"]
    assert all(len(r) < 400 for r in reasons.values()), reasons  # one line, no value dumped


def test_a_claimed_sample_count_never_weighs():
    """A 10**12 or boolean n_samples is replaced by the registered count: the average is the one of
    honest claims, and the attacker weighs 50 / 150 as registered."""
    algo, server = FedAvg(), _server()
    state, _ = algo.init_server(server)
    g = state["global"]
    honest = [(0, _honest(g, 0)), (1, _honest(g, 1, 1.0)), (2, _honest(g, 2))]
    ref, _ = algo.server_aggregate(_screen(algo, state, honest).accepted, state, server)
    for claim in (10**12, True, 1, 7.5):
        attack = _honest(g, 1, 1.0)
        attack.meta["n_samples"] = claim
        out = _screen(algo, state, [honest[0], (1, attack), honest[2]])
        assert out.claims_overridden == [1] and not out.rejected
        new, _ = algo.server_aggregate(out.accepted, state, server)
        for k in g:
            assert torch.equal(new["global"][k], ref["global"][k]), (claim, k)
    first = next(iter(g))
    moved = (ref["global"][first] - g[first]).abs().max()
    assert float(moved) == pytest.approx(50 / 150, rel=1e-5)


def test_payload_weights_refuse_unbounded_claims():
    assert payload_weights([Payload(meta={"n_samples": 3}), Payload(meta={"n_samples": 1.0})]) == [0.75, 0.25]
    for bad in (True, 0, -4, 10**400, 2**53 + 1, 0.5, "7"):
        with pytest.raises(UserInputError, match="n_samples a whole number in 1..2\\*\\*53"):
            payload_weights([Payload(meta={"n_samples": bad})])


def test_fedproto_refuses_a_wrong_width_and_inflated_counts_in_round_1():
    algo, server = FedProto(), _server()
    state, _ = algo.init_server(server)
    assert tuple(state["values"].shape) == (0, 4)

    def protos(width, counts=(5, 5)):
        return Payload({"proto.values": torch.ones(2, width), "proto.labels": torch.tensor([0, 2]),
                        "proto.counts": torch.tensor(counts, dtype=torch.int32)})

    out = _screen(algo, state, [(0, protos(4)), (1, protos(7)), (2, protos(4, (10**9, 1)))])
    assert out.accepted_ids == [0] and sorted(out.rejected) == [1, 2]
    assert "proto.values: has shape [2, 7]; allowed: [2, 4]" in out.rejected[1]
    assert "proto.counts: sums to 1000000001 samples; allowed: at most the client's 60" in out.rejected[2]
    algo.server_aggregate(out.accepted, state, server)


def test_policy_values_are_checked():
    with pytest.raises(UserInputError, match="engine.min_valid_uploads"):
        UploadPolicy(min_valid_uploads=0)
    with pytest.raises(UserInputError, match="engine.max_abs_value"):
        UploadPolicy(max_abs_value=math.inf)
    with pytest.raises(UserInputError, match="engine.aggregation: is 'krum'; allowed: mean, median, trimmed_mean"):
        AggregationRule("krum")
    with pytest.raises(UserInputError, match="engine.trim_fraction"):
        AggregationRule("trimmed_mean", trim_fraction=0.5)


# ---------------------------------------------------------------------- robust rules
def _states(rows):
    return [{"w": torch.tensor(r, dtype=torch.float32), "n": torch.tensor(i, dtype=torch.int64)}
            for i, r in enumerate(rows)]


def test_coordinate_wise_median_and_trimmed_mean_match_numpy():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(7, 5)).astype(np.float32)
    rows[3] = 1e5  # one Byzantine client
    states = _states(rows)
    med = robust_average(states, [1] * 7, AggregationRule("median"))
    assert np.allclose(med["w"].numpy(), np.median(rows, axis=0), atol=1e-6) and int(med["n"]) == 3
    tm = robust_average(states, [1] * 7, AggregationRule("trimmed_mean", trim_fraction=0.2))
    srt = np.sort(rows, axis=0)
    assert np.allclose(tm["w"].numpy(), srt[1:6].mean(axis=0), atol=1e-5)  # floor(0.2 * 7) = 1 dropped per side
    even = robust_average(_states(rows[:4]), [1] * 4, AggregationRule("median"))
    assert np.allclose(even["w"].numpy(), np.median(rows[:4], axis=0), atol=1e-6)
    assert float(tm["w"].abs().max()) < 10 and float(weighted_average(states, [1] * 7)["w"].abs().max()) > 1e4


def test_norm_clipping_bounds_every_update():
    ref = {"w": torch.zeros(3), "n": torch.tensor(0)}
    states = _states([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 300.0]])
    out = robust_average(states, [1, 1, 1], AggregationRule("norm_clip", clip_norm=1.0), reference=ref)
    assert torch.allclose(out["w"], torch.tensor([1 / 3, 1 / 3, 1 / 3]))
    auto = robust_average(states, [1, 1, 1], AggregationRule("norm_clip"), reference=ref)  # M = median norm = 2
    assert torch.allclose(auto["w"], torch.tensor([1 / 3, 2 / 3, 2 / 3]))
    assert int(out["n"]) == 1  # integer tensors: the weighted mean


# ---------------------------------------------------------------------- in the engine
class _Claims(FedAvg):
    """FedAvg whose client 1 claims ``claim`` samples, or uploads NaN (``claim`` None)."""

    claim: int | None = 10**12

    def client_update(self, state, broadcast, client):
        state, up = super().client_update(state, broadcast, client)
        if client.client_id == 1:
            if self.claim is None:
                up.tensors = {k: v * math.nan if v.is_floating_point() else v for k, v in up.tensors.items()}
            else:
                up.meta["n_samples"] = self.claim
        return state, up


def _run(tiny, tmp_path, algo, **cfg):
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine, EngineConfig

    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, algo, batch_size=16, count_macs=False)
    summary = Engine(fed, EngineConfig(rounds=1, **cfg), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, load_state(tmp_path / "checkpoint.safetensors")


@pytest.mark.slow
def test_engine_a_huge_claim_changes_nothing_and_a_bad_upload_leaves_the_others(tiny, tmp_path):
    _, _, honest = _run(tiny, tmp_path / "honest", FedAvg())
    _Claims.claim = 10**12
    _, rows, claimed = _run(tiny, tmp_path / "claim", _Claims())
    assert rows[0]["n_samples_overridden"] == [1] and rows[0]["rejected"] == 0
    for k, v in honest["server_state"]["global"].items():
        assert torch.equal(claimed["server_state"]["global"][k], v), k
    _Claims.claim = None
    summary, rows, ck = _run(tiny, tmp_path / "nan", _Claims())
    assert rows[0]["rejected"] == 1 and "round_failed" not in rows[0] and summary["rejected_uploads"] == 1
    assert list(rows[0]["rejected_reasons"]) == ["1"] and "NaN or Inf" in rows[0]["rejected_reasons"]["1"]
    assert sorted(int(c) for c in ck["committed"]) == [0, 2]  # the rejected client's state was discarded


def test_engine_below_min_valid_uploads_the_round_fails_and_keeps_the_server_state(tiny, tmp_path):
    from rafl.seeds import SeedTree

    _Claims.claim = None
    summary, rows, ck = _run(tiny, tmp_path, _Claims(), min_valid_uploads=3)
    assert rows[0]["round_failed"] is True and summary["failed_rounds"] == 1 and ck["committed"] == {}
    algo = FedAvg()
    space, supernet, ds, part = tiny
    from rafl.federation.build import build_federation

    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, algo, batch_size=16, count_macs=False)
    torch.manual_seed(SeedTree(0).server(0))  # the engine's init_server seed
    init, _ = algo.init_server(fed.server)
    for k, v in init["global"].items():
        assert torch.equal(ck["server_state"]["global"][k], v), k
