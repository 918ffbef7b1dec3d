"""One hostile client can neither stop a federation nor silently ruin it.

* Robust by default: under the run config's default ``engine.aggregation`` (``norm_clip``) a
  client's boosted (x100, in range) update moves the server's result no further than the largest
  honest client does, for the weight averages (FedAvg), FedDF's teachers and the per-class vectors
  of the prototype and header methods (:func:`rafl.federation.aggregation.bound_vectors`).
* A poisoned server state is never accepted silently: a round whose every upload is refused is a
  failed round with a reason that blames no single client, and ``rafl federate`` ends non-zero.
* Decoding inside the screening boundary: metadata of a type the wire format refuses, a huge
  header or a corrupt blob is a rejected upload of the named client (in this process, in worker
  processes and in Flower messages), checked before any tensor is allocated.
* Loaders: a large plain YAML list fails fast naming values (not aliases); profile numbers are
  bounded on both sides.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save as st_save
from torch import nn

from rafl.config import EngineConfig
from rafl.errors import UserInputError
from rafl.federation.aggregation import AggregationRule, bound_vectors, clipped_states, robust_average
from rafl.federation.algorithms.base import ClientInfo, ServerContext
from rafl.federation.algorithms.fedavg import FedAvg
from rafl.federation.payload import MAX_HEADER_BYTES, Payload
from rafl.federation.screening import RejectedUpload, UploadPolicy, screen_uploads
from rafl.federation.workers import decode_upload, encode_upload

DEFAULT = EngineConfig()
RULE = AggregationRule(DEFAULT.aggregation, DEFAULT.trim_fraction, DEFAULT.clip_norm)


def _influence(aggregate, uploads) -> list[float]:
    """Leave-one-out: the max |delta| of ``aggregate(uploads)`` against ``aggregate`` without each one."""
    everyone = aggregate(uploads)
    out = []
    for i in range(len(uploads)):
        rest = aggregate(uploads[:i] + uploads[i + 1:])
        out.append(max(float((everyone[k].double() - rest[k].double()).abs().max()) for k in everyone))
    return out


def test_the_default_rule_bounds_a_clients_influence_and_mean_does_not():
    assert DEFAULT.aggregation == "norm_clip"
    torch.manual_seed(0)
    ref = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    honest = [{k: v + 0.05 * torch.randn_like(v) for k, v in ref.items()} for _ in range(4)]
    boosted = {k: ref[k] + 100 * (honest[0][k] - ref[k]) for k in ref}
    states = [boosted, *honest]
    for rule, bounded in ((RULE, True), (AggregationRule("mean"), False)):
        moves = _influence(lambda s, r=rule: robust_average(s, [1.0] * len(s), r, reference=ref), states)
        assert (moves[0] <= max(moves[1:])) is bounded, (rule.name, moves)


def test_fedavg_server_step_under_the_default_rule_bounds_the_boosted_client():
    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

    clients = [ClientInfo(i, "custom", None, "lin", 20) for i in range(3)]
    torch.manual_seed(0)
    server = ServerContext(clients=clients, make_model=lambda arch=None, client_id=0: Lin(), public_images=None,
                           n_classes=3, aggregation=RULE)
    algo = FedAvg()
    state, _ = algo.init_server(server)
    g = state["global"]
    ups = [Payload({k: v + 0.01 * (i + 1) * torch.randn_like(v) for k, v in g.items()}, {"n_samples": 20,
                                                                                          "client_id": i})
           for i in range(3)]
    ups[1] = Payload({k: g[k] + 100 * (v - g[k]) for k, v in ups[1].tensors.items()}, dict(ups[1].meta))
    moves = _influence(lambda u: algo.server_aggregate(u, state, server)[0]["global"], ups)
    assert moves[1] <= max(moves[0], moves[2]), moves


def test_class_vectors_and_feddf_teachers_are_norm_bounded_under_the_default_rule():
    server = ServerContext(clients=[], make_model=None, public_images=None, n_classes=3, aggregation=RULE)
    torch.manual_seed(1)
    honest = [{c: torch.randn(4) for c in range(3)} for _ in range(3)]
    boosted = {c: 100 * v for c, v in honest[0].items()}
    out = bound_vectors([boosted, *honest], server)
    for c in range(3):
        assert float(out[0][c].norm()) <= max(float(h[c].norm()) for h in honest) + 1e-6
        assert all(torch.equal(out[i + 1][c], honest[i][c]) or float(out[i + 1][c].norm()) < float(honest[i][c].norm())
                   for i in range(3))
    plain = ServerContext(clients=[], make_model=None, public_images=None, n_classes=3)  # mean: unchanged
    assert torch.equal(bound_vectors([boosted], plain)[0][0], boosted[0])
    ref = {"w": torch.zeros(3)}
    teachers = clipped_states([{"w": torch.full((3,), 100.0)}, {"w": torch.ones(3)}, {"w": torch.full((3,), 2.0)}],
                              [ref] * 3, RULE)
    assert float(teachers[0]["w"].norm()) == pytest.approx(float(torch.full((3,), 2.0).norm()))  # the median norm
    assert torch.equal(teachers[1]["w"], torch.ones(3)) and torch.equal(teachers[2]["w"], torch.full((3,), 2.0))


# ---------------------------------------------------------------------- decoding and sizes
def _blob(meta_json: str) -> bytes:
    return st_save({"w": torch.zeros(2, 2)}, metadata={"rafl": meta_json})


@pytest.mark.parametrize("blob, needle", [
    (_blob(json.dumps({"n_samples": {"a": 1}})), "metadata value of type dict"),
    (_blob(json.dumps([1, 2])), "its metadata is a list"),
    (_blob("{not json"), "its metadata is not JSON"),
    ((2**40).to_bytes(8, "little") + b"{}", f"allowed: at most {MAX_HEADER_BYTES}"),
    (b"\x05\x00", "not even the 8-byte header length"),
])
def test_a_hostile_blob_is_refused_naming_its_sender(blob, needle):
    with pytest.raises(UserInputError, match="client 4") as err:
        Payload.from_bytes(blob, "client 4")
    assert needle in str(err.value)


def test_tensor_offsets_that_do_not_fit_are_refused_before_any_tensor_is_read():
    header = json.dumps({"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 16]}}).encode()
    blob = len(header).to_bytes(8, "little") + header + bytes(16)
    with pytest.raises(UserInputError, match="does not fit its blob"):
        Payload.from_bytes(blob, "client 2")
    with pytest.raises(UserInputError, match="holds 40 bytes; allowed: at most 39"):
        Payload.from_bytes(b"x" * 40, "client 2", max_bytes=39)


def test_the_worker_path_turns_a_bad_upload_into_a_rejection_not_a_run_error():
    up = Payload({"w": torch.ones(3)}, {"n_samples": 3})
    up.meta["note"] = {"nested": 1}  # changed after construction: the wire format has no dicts
    sent = encode_upload(up, limit=10_000)
    assert isinstance(sent, RejectedUpload) and "payload.meta.note" in sent.reason
    big = Payload({"w": torch.ones(3)}, {"s": "x" * 5000})
    sent = encode_upload(big, limit=1000)  # refused before it is serialized or sent
    assert isinstance(sent, RejectedUpload) and "allowed: at most 1000" in sent.reason
    got = decode_upload(_blob(json.dumps({"k": {"a": 1}})), "client 1", None)
    assert isinstance(got, RejectedUpload) and "dict" in got.reason
    ok = decode_upload(encode_upload(Payload({"w": torch.ones(3)}, {"n_samples": 3}), 10_000), "client 1", 10_000)
    assert isinstance(ok, Payload) and ok.meta == {"n_samples": 3}


def test_screening_rejects_in_process_uploads_of_wire_refused_types_naming_the_client():
    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

    clients = [ClientInfo(i, "custom", None, "lin", 10) for i in range(2)]
    server = ServerContext(clients=clients, make_model=lambda arch=None, client_id=0: Lin(), public_images=None,
                           n_classes=2)
    algo = FedAvg()
    state, _ = algo.init_server(server)
    good = Payload(dict(state["global"]), {"n_samples": 10})
    bad = Payload(dict(state["global"]), {"n_samples": 10})
    bad.meta["x"] = {"a": [1]}
    weird = Payload(dict(state["global"]), {"n_samples": 10})
    weird.tensors = {"fc.weight": "not a tensor"}
    for hostile in (bad, weird):
        out = screen_uploads([(0, good), (1, hostile)], algo, state, clients, 2, UploadPolicy(), limits={0: 10**6,
                                                                                                         1: 10**6},
                             sender=lambda c: f"client {c}")
        assert out.accepted_ids == [0] and list(out.rejected) == [1] and "client 1" in out.rejected[1]


def test_a_flower_reply_with_refused_metadata_is_an_error_naming_the_client():
    flwr_app = pytest.importorskip("flwr.app")
    from rafl.federation import flower_wire

    content = flwr_app.RecordDict(flower_wire._blob_records(_blob(json.dumps({"m": {"x": 1}})), ".3"))
    with pytest.raises(UserInputError, match="client 3") as err:
        flower_wire.records_to_payload(content, "client 3", ".3", 10_000)
    assert "metadata value of type dict" in str(err.value)
    huge = flwr_app.RecordDict(flower_wire._blob_records((2**40).to_bytes(8, "little") + b"{}", ".3"))
    with pytest.raises(UserInputError, match="header of"):
        flower_wire.records_to_payload(huge, "client 3", ".3", None)


# ---------------------------------------------------------------------- failed rounds
class _AllNaN(FedAvg):
    """FedAvg whose every client uploads NaN in round 2 (the server state looks poisoned)."""

    def client_update(self, state, broadcast, client):
        state, up = super().client_update(state, broadcast, client)
        if client.round == 2:
            up.tensors = {k: v * math.nan if v.is_floating_point() else v for k, v in up.tensors.items()}
        return state, up


class _WireRefused(FedAvg):
    """FedAvg whose client 1 sets a dict in its upload's metadata (the wire format refuses it)."""

    def client_update(self, state, broadcast, client):
        state, up = super().client_update(state, broadcast, client)
        if client.client_id == 1:
            up.meta["extra"] = {"a": 1}
        return state, up


@pytest.mark.parametrize("workers", [1, 2])
def test_wire_refused_metadata_is_a_rejected_upload_and_the_run_completes(tiny, tmp_path, workers):
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, _WireRefused(local_epochs=1),
                              batch_size=16, count_macs=False)
    summary = Engine(fed, EngineConfig(rounds=1, workers=workers), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert summary["rejected_uploads"] == 1 and summary["failed_rounds"] == 0
    assert list(row["rejected_reasons"]) == ["1"] and "payload.meta.extra" in row["rejected_reasons"]["1"]


def test_a_round_whose_every_upload_is_refused_fails_without_blaming_a_client(tiny, tmp_path, capsys):
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, _AllNaN(local_epochs=1), batch_size=16,
                              count_macs=False)
    summary = Engine(fed, EngineConfig(rounds=2), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    assert summary["failed_rounds"] == 1 and summary["rejected_uploads"] == 3
    (why,) = summary["failed_round_reasons"]
    assert why.startswith("round 2 failed: 0 valid upload(s) of 3") and "server state" in why
    err = capsys.readouterr().err
    assert "rejected the upload of" not in err and "round 2 failed" in err  # no client singled out


def test_a_diverged_server_step_is_a_failed_round_not_a_run_error(tiny, tmp_path, capsys):
    """FedTGP's server training with a learning rate that overflows: every round fails with the
    reason naming algorithm.server_lr, the run completes with its rounds recorded and no new state."""
    from rafl.federation.algorithms import get_algorithm
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny
    algo = get_algorithm("fedtgp")(local_epochs=1, server_epochs=20, server_lr=1e12)
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, algo, batch_size=16, count_macs=False)
    summary = Engine(fed, EngineConfig(rounds=2), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    assert summary["rounds"] == 2 and summary["failed_rounds"] == 2 and summary["rejected_uploads"] == 0
    for rnd, why in enumerate(summary["failed_round_reasons"], 1):
        assert why.startswith(f"round {rnd} failed: the server step diverged on the round's 3 accepted upload(s): "
                              "algorithm.server_lr: server training of the global prototypes diverged"), why
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("round_failed") for r in rows] == [True, True]
    assert "the server state is unchanged" in capsys.readouterr().err


def test_rafl_federate_exits_non_zero_when_rounds_failed(tmp_path):
    from click.testing import CliRunner

    from rafl.cli.federate import FAILED_ROUNDS_EXIT, exit_failed_rounds

    summary = {"failed_rounds": 2, "rounds": 6, "failed_round_reasons": ["round 3 failed: 0 valid upload(s) of 3"]}
    import click

    @click.command()
    def cmd():
        exit_failed_rounds(summary, tmp_path)

    res = CliRunner().invoke(cmd)
    assert res.exit_code == FAILED_ROUNDS_EXIT != 0
    assert "2 of 6 round(s) failed" in res.output and "round 3 failed" in res.output
    res = CliRunner().invoke(click.command()(lambda: exit_failed_rounds({"failed_rounds": 0, "rounds": 6}, tmp_path)))
    assert res.exit_code == 0


# ---------------------------------------------------------------------- loaders
def test_a_large_plain_yaml_list_fails_fast_naming_values_not_aliases():
    from rafl.io import MAX_YAML_NODES, load_yaml

    with pytest.raises(UserInputError) as err:
        load_yaml("- 1\n" * (MAX_YAML_NODES + 10), "big.yaml")
    assert f"has more than {MAX_YAML_NODES} values" in str(err.value) and "alias" not in str(err.value)
    assert load_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize("change, field", [
    ({"throughput_gmacs": 1e300}, "throughput_gmacs"),
    ({"epoch_samples": 10**18}, "epoch_samples"),
    ({"batch_size": 2**60}, "batch_size"),
    ({"budgets": {"energy_mj": 1e200}}, "budgets.energy_mj"),
])
def test_profile_numbers_are_bounded_on_both_sides(change, field):
    from rafl.search.profile import DeviceProfile

    data = {"name": "d", "throughput_gmacs": 10.0, "mem_bandwidth_gbs": 5.0, **change}
    with pytest.raises(UserInputError, match=field.replace(".", r"\.")):
        DeviceProfile.from_dict(data)


# ---------------------------------------------------------------------- BN statistics, lone uploads, rollback
class _BNAttack(FedAvg):
    """FedAvg whose client 1 sets one BatchNorm running variance to -1e5 in every upload."""

    def client_update(self, state, broadcast, client):
        state, up = super().client_update(state, broadcast, client)
        if client.client_id == 1:
            name = next(k for k in up.tensors if k.endswith("running_var"))
            up.tensors[name] = up.tensors[name].clone()
            up.tensors[name][0] = -1e5
        return state, up


@pytest.mark.parametrize("aggregation", ["norm_clip", "mean"])
def test_a_negative_bn_variance_is_rejected_and_the_model_stays_finite(tiny, tmp_path, aggregation):
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, _BNAttack(local_epochs=1), batch_size=16,
                              count_macs=False)
    summary = Engine(fed, EngineConfig(rounds=2, aggregation=aggregation), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["failed_rounds"] == 0 and summary["rejected_uploads"] == 2
    for row in rows:
        (why,) = row["rejected_reasons"].values()
        assert list(row["rejected_reasons"]) == ["1"] and "running_var: is a BatchNorm running variance with a " \
            "value of -1e+05; allowed: values >= 0" in why, why
    from rafl.federation.store import load_state

    ck = load_state(tmp_path / "checkpoint.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in ck["broadcast_tensors"].values() if t.is_floating_point())


def test_bn_statistics_far_from_the_rounds_median_are_rejected():
    from rafl.federation.screening import BN_VAR_RATIO, bn_outliers, check_bn_stats

    torch.manual_seed(0)
    honest = [Payload({"bn.running_var": 1 + 0.1 * torch.rand(4), "bn.running_mean": 0.1 * torch.randn(4),
                       "bn.num_batches_tracked": torch.tensor(3)}) for _ in range(3)]
    assert bn_outliers(list(enumerate(honest))) == {}
    check_bn_stats(Payload({"bn.running_var": torch.zeros(4)}))  # a channel that never fired: honest
    with pytest.raises(UserInputError, match=r"bn.running_var: is a BatchNorm running variance with a value of -1"):
        check_bn_stats(Payload({"bn.running_var": torch.tensor([1.0, -1.0])}))
    big = Payload({**honest[0].tensors, "bn.running_var": torch.tensor([1.0, 1.0, 2 * BN_VAR_RATIO, 1.0])})
    tiny_var = Payload({**honest[0].tensors, "bn.running_var": torch.tensor([1.0, 1e-9, 1.0, 1.0])})
    shifted = Payload({**honest[0].tensors, "bn.running_mean": torch.tensor([0.0, 0.0, 0.0, 500.0])})
    out = bn_outliers([(0, honest[0]), (1, big), (2, honest[1]), (3, tiny_var), (4, shifted), (5, honest[2])])
    assert sorted(out) == [1, 3, 4], out
    assert out[1].startswith("bn.running_var: is a BatchNorm running variance of 2e+03 in channel 2")
    assert "in channel 1" in out[3] and out[4].startswith("bn.running_mean: is a BatchNorm running mean of 500 in channel 3")
    # with fewer than 3 holders the round sets no bound (the per-upload checks still apply)
    assert bn_outliers([(0, honest[0]), (1, big)]) == {}


def test_non_finite_logits_are_never_correct():
    from rafl.federation.training import hits

    logits = torch.tensor([[math.nan, 0.0], [0.0, 1.0], [math.inf, 0.0]])
    assert hits(logits, torch.tensor([0, 1, 0])) == 1


def test_a_lone_upload_is_clipped_to_the_bound_carried_from_earlier_rounds():
    """A round with fewer than 3 uploads is clipped against the running median of earlier rounds'
    update norms, never its own (the attacker's) median; the lone attacker cannot raise it."""
    from rafl.federation.aggregation import ClipBounds

    torch.manual_seed(0)
    ref = {"w": torch.zeros(10)}
    bounds = ClipBounds()
    for _ in range(3):  # honest rounds of 3 clients: updates of norm ~1
        ups = [{"w": ref["w"] + torch.randn(10) / math.sqrt(10)} for _ in range(3)]
        robust_average(ups, [1.0] * 3, RULE, reference=ref, bounds=bounds)
    carried = bounds.carried("weights")
    assert 0.5 < carried < 2.0
    boosted = {"w": 100 * torch.randn(10) / math.sqrt(10)}
    alone = robust_average([boosted], [1.0], RULE, reference=ref, bounds=bounds)
    assert float(alone["w"].norm()) == pytest.approx(carried, rel=1e-6)  # moved by the carried bound only
    assert float(robust_average([boosted], [1.0], RULE, reference=ref)["w"].norm()) > 50 * carried  # the old rule
    for _ in range(5):  # the attacker alone, round after round: the bound does not grow
        robust_average([boosted], [1.0], RULE, reference=ref, bounds=bounds)
    assert bounds.carried("weights") <= carried * (1 + 1e-9)
    # round 1, no history: the bound is the norm of the model the clients started from
    fresh = ClipBounds()
    start = {"w": torch.ones(10)}
    out = robust_average([{"w": start["w"] + boosted["w"]}], [1.0], RULE, reference=start, bounds=fresh)
    assert float((out["w"] - start["w"]).norm()) == pytest.approx(math.sqrt(10), rel=1e-6)
    assert ClipBounds.from_json(json.loads(json.dumps(bounds.to_json()))) == bounds  # kept in the checkpoint


class _Boosted(FedAvg):
    """FedAvg whose every client sends its weights' update x100 (in range) from round 2 on."""

    def client_update(self, state, broadcast, client):
        state, up = super().client_update(state, broadcast, client)
        if client.round >= 2:
            g = broadcast.tensors
            up.tensors = {k: g[k] + 100 * (v - g[k]) if v.is_floating_point() and "running" not in k else v
                          for k, v in up.tensors.items()}
        return state, up


def test_a_lone_boosted_upload_in_a_run_moves_the_model_no_further_than_the_carried_bound(tiny, tmp_path):
    """clients_per_round 1 after an honest round of 3: every lone (boosted x100) upload moves the global
    model at most by the carried bound, and no later round fails."""
    from rafl.federation.aggregation import ClipBounds, update_norms
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine
    from rafl.federation.store import load_state
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, _Boosted(local_epochs=1), batch_size=16,
                              count_macs=False)
    Engine(fed, EngineConfig(rounds=1), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    ck = load_state(tmp_path / "checkpoint.safetensors")
    before = dict(ck["broadcast_tensors"])
    carried = ClipBounds.from_json(json.loads(ck["counters"])["clip_bounds"]).carried("weights")
    cfg = EngineConfig(rounds=4, clients_per_round=1)
    summary = Engine(fed, cfg, tmp_path, progress=False, observers=[RunReport(tmp_path)]).run(resume=True)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["failed_rounds"] == 0 and summary["rejected_uploads"] == 0
    after = load_state(tmp_path / "checkpoint.safetensors")["broadcast_tensors"]
    floats = {k: v for k, v in before.items() if v.is_floating_point()}
    assert update_norms([after], floats)[0] <= 3 * carried * (1 + 1e-6), rows  # three lone rounds, each <= carried


class _NaNServer(FedAvg):
    """FedAvg whose server step returns a NaN global model in round 2."""

    def server_aggregate(self, uploads, server_state, server):
        state, broadcast = super().server_aggregate(uploads, server_state, server)
        if server.round == 2:
            key = next(k for k, v in broadcast.tensors.items() if v.is_floating_point())
            broadcast = Payload({**broadcast.tensors, key: broadcast.tensors[key] * math.nan}, dict(broadcast.meta))
        return state, broadcast


def test_a_round_whose_aggregate_is_not_finite_fails_and_resume_loads_the_last_good_state(tiny, tmp_path):
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine
    from rafl.federation.store import load_state
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, _NaNServer(local_epochs=1), batch_size=16,
                              count_macs=False)
    Engine(fed, EngineConfig(rounds=1), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    good = load_state(tmp_path / "checkpoint.safetensors")["broadcast_tensors"]
    summary = Engine(fed, EngineConfig(rounds=2), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run(resume=True)
    (why,) = summary["failed_round_reasons"]
    assert why.startswith("round 2 failed: the aggregate of the accepted upload(s) of clients 0, 1, 2 has NaN or "
                          "Inf values in "), why
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert row["round_failed"] and 0 <= row["model.acc_mean_over_clients"] <= 1
    ck = load_state(tmp_path / "checkpoint.safetensors")
    assert ck["round"] == 2 and all(torch.equal(ck["broadcast_tensors"][k], good[k]) for k in good)  # rolled back
