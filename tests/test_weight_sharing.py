"""HeteroFL, FedRolex and uniform: exactness of the weight sharing, the federated supernet, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.data import load_dataset, make_partition
from rafl.errors import UserInputError
from rafl.federation.aggregation import AggregationRule, payload_weights, robust_average, weighted_average
from rafl.federation.algorithms import ServerContext, get_algorithm
from rafl.federation.algorithms.heterofl import index_map
from rafl.federation.build import build_federation, build_group_federation
from rafl.federation.engine import CHECKPOINT, Engine, EngineConfig
from rafl.federation.payload import Payload
from rafl.federation.runners import client_context
from rafl.federation.store import load_state
from rafl.federation.training import evaluate_accuracy, recalibrate_local_bn
from rafl.federation.weight_sharing import (
    _clipped_uploads,
    extract,
    fold_kernel_transforms,
    masked_average,
    nas_index_map,
    prefix_index_map,
)
from rafl.models import make_member, resolve_models
from rafl.reports.run import RunReport
from rafl.search.federation_search import uniform_arch
from rafl.search.profile import load_profile
from rafl.supernet import SearchSpace, build_supernet, extract_subnet
from rafl.supernet.model import recalibrate_bn
from rafl.supernet.server_data import calibration_sample

BN_KEYS = ("running_mean", "running_var", "num_batches_tracked")
SLICED = ["cnn4@1", "cnn4@0.5", "cnn4@0.25", "cnn4@0.125"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    supernet = build_supernet(space).eval()
    with torch.no_grad():  # trained-like kernel transformation matrices (not the identity they start at)
        for name, p in supernet.named_parameters():
            if name.endswith("_matrix"):
                p.add_(0.05 * torch.randn_like(p))
    ds = load_dataset("digits", limit_per_class=10)
    part = make_partition(ds.labels.numpy(), "dirichlet", 3, 0, alpha=1.0, min_samples=5, public_fraction=0.2)
    return space, supernet, ds, part


def _engine(fed, tmp_path, rounds=2, **engine):
    summary = Engine(fed, EngineConfig(rounds=rounds, seed=1, target_accuracy=None, **engine), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    history = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, history, load_state(tmp_path / CHECKPOINT)


def test_masked_average_with_full_cover_is_weighted_average_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(5, 3, generator=g), "n": torch.tensor(3 + i)} for i in range(3)]
    ups = [Payload(s, {"n_samples": c}) for s, c in zip(states, (7, 11, 13))]
    ref = weighted_average([u.tensors for u in ups], payload_weights(ups))
    index = {k: (k, torch.arange(v.numel()).reshape(v.shape)) for k, v in states[0].items()}
    got = masked_average({k: torch.zeros_like(v) for k, v in states[0].items()},
                         [(s, index, c) for s, c in zip(states, (7, 11, 13))])
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_masked_average_averages_each_element_over_its_holders():
    glob = {"w": torch.full((4,), 9.0)}
    a = ({"w": torch.tensor([1.0, 2.0])}, {"w": ("w", torch.tensor([0, 1]))}, 1.0)
    b = ({"w": torch.tensor([3.0])}, {"w": ("w", torch.tensor([1]))}, 3.0)
    assert masked_average(glob, [a, b])["w"].tolist() == [1.0, (2.0 + 9.0) / 4, 9.0, 9.0]


def test_masked_norm_clip_with_full_cover_is_fedavgs_norm_clip():
    g = torch.Generator().manual_seed(0)
    glob = {"w": torch.randn(5, 3, generator=g), "n": torch.tensor(2)}
    states = [{"w": glob["w"] + (100.0 if i == 2 else 1.0) * torch.randn(5, 3, generator=g), "n": torch.tensor(3 + i)}
              for i in range(4)]
    counts = (7, 11, 13, 5)
    rule = AggregationRule("norm_clip")
    ref = robust_average(states, [float(c) for c in counts], rule, reference=glob)
    index = {k: (k, torch.arange(v.numel()).reshape(v.shape)) for k, v in glob.items()}
    got = masked_average(glob, [(s, index, c) for s, c in zip(states, counts)], rule)
    assert torch.allclose(got["w"], ref["w"], atol=1e-6) and torch.equal(got["n"], ref["n"])
    assert not torch.allclose(got["w"], masked_average(glob, [(s, index, c) for s, c in zip(states, counts)])["w"])


def _slices(sizes, total):
    return [{"w": ("w", torch.arange(k))} for k in sizes], {"w": torch.zeros(total)}


def test_masked_norm_clip_bounds_a_boosted_slice_by_the_largest_honest_one():
    """Three honest clients of different widths and one boosted x100: the boosted client moves the
    global model no further than the largest honest client (the influence bound); honest updates of
    equal per-element size are not clipped, however wide or narrow their slice."""
    g = torch.Generator().manual_seed(3)
    index, glob = _slices((8, 4, 2, 8), 8)
    deltas = [torch.randn(k, generator=g).sign() for k in (8, 4, 2, 8)]  # RMS 1 each
    deltas[3] = deltas[3] * 100
    rule = AggregationRule("norm_clip")
    ups = [({"w": d}, ix, 1.0) for d, ix in zip(deltas, index)]

    def influence(i):  # how far upload i moves the global model: with it against without it
        rest = [u for j, u in enumerate(ups) if j != i]
        return float((masked_average(glob, ups, rule)["w"] - masked_average(glob, rest, rule)["w"]).norm())

    honest = max(influence(i) for i in range(3))
    assert influence(3) <= honest * 1.0001
    clipped = _clipped_uploads(glob, ups, rule)
    assert [torch.equal(c[0]["w"], u[0]["w"]) for c, u in zip(clipped, ups)] == [True, True, True, False]
    unclipped = float((masked_average(glob, ups)["w"] - masked_average(glob, ups[:3])["w"]).norm())
    assert unclipped > 10 * honest  # under plain Eq. 3 the boosted client dominates


@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
def test_masked_coordinatewise_rules_use_the_holders_of_each_element(name):
    index, glob = _slices((3, 3, 3, 1), 4)
    vals = [torch.tensor([1.0, 5.0, 2.0]), torch.tensor([2.0, 6.0, 3.0]), torch.tensor([1000.0, 7.0, 4.0]),
            torch.tensor([-1000.0])]
    got = masked_average(glob, [({"w": v}, ix, 1.0) for v, ix in zip(vals, index)],
                         AggregationRule(name, trim_fraction=0.25))
    # element 0: 4 holders {1, 2, 1000, -1000}; elements 1, 2: 3 holders; element 3: held by none
    first = (1.0 + 2.0) / 2
    assert got["w"].tolist() == [first, 6.0, 3.0, 0.0]


@pytest.mark.parametrize("kind,aggregation", [("nas", "mean"), ("sliced", "mean"), ("nas", "norm_clip")])
@pytest.mark.slow
def test_heterofl_with_every_client_holding_the_full_model_is_fedavg(kind, aggregation, tiny, tmp_path):
    """Bit for bit under plain averaging; under the default norm_clip up to float32 rounding."""
    space, supernet, ds, part = tiny
    runs = {}
    for name in ("fedavg", "heterofl"):
        algo = get_algorithm(name)(local_epochs=1, **({"static_bn": False} if name == "heterofl" else {}))
        torch.manual_seed(0)
        if kind == "nas":
            fed, _ = build_federation(ds, part, supernet, [space.largest()] * 3, algo, batch_size=16, count_macs=False)
        else:
            fed, _ = build_group_federation(ds, part, ["cnn4@0.125"], algo, feature_dim=16, batch_size=16)
        runs[name] = (fed, *_engine(fed, tmp_path / name, aggregation=aggregation))
    fedavg_global = runs["fedavg"][3]["server_state"]["global"]
    fed_h, ck_h = runs["heterofl"][0], runs["heterofl"][3]
    index = index_map(ck_h["server_state"]["layout"], fed_h.clients[0], 3, False)
    mine = extract(ck_h["server_state"]["global"], index)
    assert set(mine) == set(fedavg_global)
    keys = ("model.acc_mean_over_clients", "model.acc_sample_weighted", "bytes_up")
    if aggregation == "mean":
        assert [[r[k] for k in keys] for r in runs["fedavg"][2]] == [[r[k] for k in keys] for r in runs["heterofl"][2]]
        assert all(torch.equal(mine[k], fedavg_global[k]) for k in mine)
    else:
        assert [r["bytes_up"] for r in runs["fedavg"][2]] == [r["bytes_up"] for r in runs["heterofl"][2]]
        assert all(torch.allclose(mine[k].double(), fedavg_global[k].double(), atol=1e-5) for k in mine)


def test_a_weight_no_client_holds_never_changes(tiny, tmp_path):
    space, supernet, ds, part = tiny
    archs = [space.smallest(), space.smallest(), space.middle()]
    fed, _ = build_federation(ds, part, supernet, archs, get_algorithm("heterofl")(local_epochs=1, static_bn=True),
                              batch_size=16, count_macs=False)
    start = fed.algorithm.init_server(fed.server)[0]["global"]
    *_, ck = _engine(fed, tmp_path, rounds=1)
    end = ck["server_state"]["global"]
    held = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in start.items()}
    for arch in archs:
        for key, (g, flat) in nas_index_map(space, arch).items():
            if not key.endswith(("running_mean", "running_var", "num_batches_tracked")):  # static BN: not sent
                held[g][flat.reshape(-1)] = True
    n_free = n_moved = 0
    for k, v in start.items():
        free = ~held[k]
        assert torch.equal(v.reshape(-1)[free], end[k].reshape(-1)[free]), k
        n_free += int(free.sum())
        n_moved += int((v.reshape(-1)[held[k]] != end[k].reshape(-1)[held[k]]).sum())
    assert n_free > 0 and n_moved > 0
    assert all(torch.equal(start[k], end[k]) for k in start if k.endswith("_matrix"))


def _recalibrated_slice(fed, algo, global_state, layout, info, round_):
    """BN statistics of ``info``'s slice of ``global_state``, recalibrated on the public sample the
    searched subnets were recalibrated on."""
    model = fed.server.make_model(arch=info.arch)
    index = index_map(layout, info, round_, algo.rolling)
    model.load_state_dict(extract(global_state, index, [k for k in index if not k.endswith(BN_KEYS)]), strict=False)
    pool = fed.server.public_images
    calib = pool[torch.as_tensor(calibration_sample(np.arange(len(pool)), 512))]
    recalibrate_bn(model, [calib[i:i + 64] for i in range(0, len(calib), 64)], n_batches=None)
    return {k: v for k, v in model.state_dict().items() if k.endswith(BN_KEYS[:2])}


@pytest.mark.parametrize("name", ["heterofl", "fedrolex"])
@pytest.mark.slow
def test_static_bn_server_statistics_are_the_floors_then_follow_the_global_weights(name, tiny, tmp_path):
    """``sbn_statistics: server``: a client evaluates its slice with BN statistics recalibrated on the
    server's public sample (before round 1 for the smallest subnet, whose slice is the supernet's
    own subnet: exactly the statistics the no-training floor deploys), never sent up; after a round,
    those of its trained slice."""
    space, supernet, ds, part = tiny
    archs = [space.smallest(), space.middle(), space.largest()]
    algo = get_algorithm(name)(local_epochs=1, static_bn=True, sbn_statistics="server")
    fed, _ = build_federation(ds, part, supernet, archs, algo, batch_size=16, count_macs=False)
    state, broadcast = algo.init_server(fed.server)
    assert sorted(state["sbn"]) == sorted({c.model_key for c in fed.clients})
    floor = fed.server.make_model(arch=space.smallest()).state_dict()
    for info in fed.clients:
        down = algo.client_broadcast(broadcast, info)
        want = _recalibrated_slice(fed, algo, state["global"], state["layout"], info, 1)
        assert want and all(torch.allclose(down.tensors[k], v, rtol=1e-4, atol=1e-5) for k, v in want.items())
        if info.arch == space.smallest():
            assert all(torch.allclose(down.tensors[k], floor[k], rtol=1e-4, atol=1e-5) for k in want)
        assert not any(k.startswith("sbn.") for k in down.tensors)
        assert not any(k.endswith(BN_KEYS) for k in algo.upload_spec(state, info))
    _, history, ck = _engine(fed, tmp_path / "run", rounds=1)
    end = ck["server_state"]
    for info in fed.clients:
        mine = end["sbn"][info.model_key]
        want = _recalibrated_slice(fed, algo, end["global"], end["layout"], info, 2)
        assert all(torch.allclose(mine[k], v, rtol=1e-4, atol=1e-5) for k, v in want.items())
        assert any(not torch.allclose(mine[k], state["sbn"][info.model_key][k]) for k in want)
    assert history[-1]["model.acc_mean_over_clients"] > 0.2
    # a fine-tuned slice (the -ft row: its upload, no statistics) is scored with its client's own
    ctx = client_context(fed, 1, 0, 2)
    broadcast = Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"]))
    _, tuned = algo.client_update({}, algo.client_broadcast(broadcast, fed.clients[0]), ctx)
    assert not any(k.endswith(BN_KEYS) for k in tuned.tensors)
    model = algo._model(ctx, tuned.tensors)
    recalibrate_local_bn(model, ctx.train_loader)
    got = algo.evaluate(algo.prepare_evaluation({}, tuned, ctx), ctx)
    assert (got["model.correct"], got["model.total"]) == tuple(map(float, evaluate_accuracy(model, ctx.test_loader)))


def test_static_bn_server_statistics_bad_input(tiny):
    space, supernet, ds, part = tiny
    with pytest.raises(UserInputError, match="static_bn is false") as err:
        get_algorithm("heterofl")(sbn_statistics="server")
    assert err.value.field == "algorithm.sbn_statistics"
    with pytest.raises(UserInputError, match="local, server"):
        get_algorithm("fedrolex")(static_bn=True, sbn_statistics="clients")
    no_pool = make_partition(ds.labels.numpy(), "dirichlet", 3, 0, alpha=1.0, min_samples=5, public_fraction=0.0)
    archs = [space.smallest()] * 3
    with pytest.raises(UserInputError, match="public pool") as err:
        build_federation(ds, no_pool, supernet, archs, get_algorithm("heterofl")(static_bn=True, sbn_statistics="server"),
                         batch_size=16, count_macs=False)
    assert err.value.field == "algorithm.sbn_statistics"


@pytest.mark.parametrize("name", ["heterofl", "fedrolex"])
@pytest.mark.slow
def test_merge_then_extract_returns_each_clients_trained_weights(name, tiny):
    """One client per element: the merged supernet, cut by ofa's own extraction (what `rafl search`
    does with the federated supernet), gives back exactly the weights the client uploaded."""
    space, supernet, ds, part = tiny
    algo = get_algorithm(name)(static_bn=False)
    archs = [space.smallest(), space.middle(), space.largest()]
    fed, _ = build_federation(ds, part, supernet, archs, algo, batch_size=16, count_macs=False)
    state, _ = algo.init_server(fed.server)
    g = torch.Generator().manual_seed(1)
    for cid in range(3):
        fed.server.round = 3  # FedRolex: a window that wraps around
        info = fed.clients[cid]
        spec = algo.upload_spec(state, info)
        trained = {k: (torch.randn(s, generator=g) if not k.endswith("num_batches_tracked") else torch.tensor(5))
                   for k, s in spec.items()}
        new, _ = algo.server_aggregate([Payload(trained, {"client_id": cid, "n_samples": 1})], state, fed.server)
        index = index_map(new["layout"], info, 3, algo.rolling)
        assert all(torch.equal(v, trained[k]) for k, v in extract(new["global"], index).items())
        if name == "heterofl":  # the prefix layout is ofa's extraction of the saved supernet
            net = algo.federated_supernet(new, fed.server)
            sub = extract_subnet(net, info.arch).state_dict()
            # every weight and statistic; ofa's extraction restarts the elastic blocks' BN counters
            assert all(torch.equal(sub[k], trained[k]) for k in trained if not k.endswith("num_batches_tracked")), cid


def test_folding_keeps_the_smallest_used_kernel_exactly(tiny):
    space, supernet, *_ = tiny
    arch = space.smallest()
    folded = build_supernet(space)
    folded.load_state_dict(fold_kernel_transforms(supernet))
    a, b = extract_subnet(supernet.eval(), arch).state_dict(), extract_subnet(folded.eval(), arch).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    la = extract_subnet(supernet, space.largest()).state_dict()
    lb = extract_subnet(folded, space.largest()).state_dict()
    assert any(not torch.equal(la[k], lb[k]) for k in la)  # a larger kernel holds the smaller filters in its centre
    # folding down to the largest kernel only (no client uses a smaller one) changes nothing
    same = build_supernet(space)
    same.load_state_dict(fold_kernel_transforms(supernet, [max(space.ks_choices)] * len(supernet.blocks[1:])))
    assert all(torch.equal(v, supernet.state_dict()[k]) for k, v in same.state_dict().items())


def test_fedrolex_window_rolls_one_channel_per_round(tiny):
    space, *_ = tiny
    arch = space.smallest()
    key = next(k for k in nas_index_map(space, arch) if k.endswith("depth_conv.conv.weight") and k.startswith("blocks.1."))
    r1 = nas_index_map(space, arch)[key][1][:, 0, 0, 0]
    m = None
    from rafl.federation.weight_sharing import middle_channels

    m = middle_channels(space)
    r2 = nas_index_map(space, arch, [1] * len(m))[key][1][:, 0, 0, 0]
    kk = r1[1] - r1[0]  # flat stride of one channel
    assert torch.equal(r2, (r1 + kk) % (m[0] * kk))
    local = make_member("cnn4@0.5", 10, 16).state_dict()
    glob = make_member("cnn4@1", 10, 16).state_dict()
    w1 = prefix_index_map(local, glob, round_=1)["backbone.0.weight"][1][:, 0, 0, 0] // glob["backbone.0.weight"][0].numel()
    w40 = prefix_index_map(local, glob, round_=30)["backbone.0.weight"][1][:, 0, 0, 0] // glob["backbone.0.weight"][0].numel()
    assert w1.tolist() == list(range(16)) and w40.tolist() == [(29 + j) % 32 for j in range(16)]


@pytest.mark.parametrize("name", ["heterofl", "fedrolex"])
@pytest.mark.slow
def test_two_rounds_on_width_sliced_cnn4_and_nas_subnets(name, tiny, tmp_path):
    space, supernet, ds, part = tiny
    algo = get_algorithm(name)(local_epochs=1)
    fed, _ = build_group_federation(ds, part, resolve_models("heterofl-cnn4")[1:], algo, feature_dim=16, batch_size=16)
    _, hist, _ = _engine(fed, tmp_path / "sliced")
    assert 0 <= hist[-1]["model.acc_mean_over_clients"] <= 1
    # bytes: each client downloads and uploads its own slice only
    sizes = {m: sum(p.numel() for p in make_member(m, 10, 16).parameters()) for m in SLICED}
    assert sizes["cnn4@0.125"] < sizes["cnn4@0.5"] < sizes["cnn4@1"]
    assert hist[0]["bytes_down"] < 3 * 4 * sizes["cnn4@0.5"]
    fed, _ = build_federation(ds, part, supernet, [space.smallest(), space.middle(), space.largest()],
                              get_algorithm(name)(local_epochs=1), batch_size=16, count_macs=False)
    _, hist, _ = _engine(fed, tmp_path / "nas")
    assert 0 <= hist[-1]["model.acc_mean_over_clients"] <= 1 and hist[-1]["bytes_up"] > 0


def test_width_sliced_models_and_scaler():
    from rafl.models.sliced import set_scalers

    assert resolve_models("heterofl-resnet18") == ["resnet18@1", "resnet18@0.5", "resnet18@0.25", "resnet18@0.125"]
    torch.manual_seed(0)
    m = make_member("cnn4@0.25", 10, 16)
    x = torch.randn(4, 1, 16, 16)
    assert m(x).shape == (4, 10) and m.features(x).shape == (4, 4)
    m.eval()
    y_eval = m.features(x)
    set_scalers(m, False)
    assert torch.equal(m.features(x), y_eval)  # the scaler is the identity at inference
    with pytest.raises(UserInputError, match="rate in"):
        resolve_models("cnn4@2")


def test_bad_input_other_supernet_and_not_width_sliceable(tiny):
    space, supernet, ds, part = tiny
    algo = get_algorithm("heterofl")()
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, algo, batch_size=16, count_macs=False)
    other = SearchSpace(width_mult=0.35, resolutions=(16,), n_classes=10)
    foreign = build_supernet(other)
    srv = fed.server
    ctx = ServerContext(clients=srv.clients, make_model=lambda arch=None, client_id=None: extract_subnet(foreign, arch),
                        public_images=None, n_classes=10, space=space, supernet=supernet)
    with pytest.raises(UserInputError, match="comes from another supernet"):
        algo.check_models(ctx)
    with pytest.raises(UserInputError, match="not width-sliceable"):
        build_group_federation(ds, part, ["cnn4@0.5", "cnn3-small"], algo, feature_dim=16)


def _one_error_line(result):
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_cli_bad_input_exits_2_before_round_1(tmp_path, tiny_supernet, monkeypatch):
    path, _ = tiny_supernet
    (tmp_path / "myplug.py").write_text("from rafl.models.zoo import build_model\n"
                                        "def make(n_classes, feature_dim):\n"
                                        "    return build_model('cnn3-small', n_classes, feature_dim)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["federate", "--no-progress", "--set", f"supernet.path={path}", "--set", "data.limit_per_class=10",
            "--set", "clients.n=3"]
    out = tmp_path / "runs"
    line = _one_error_line(CliRunner().invoke(cli, [*base[:2], *base[4:], "--out", str(out), "--set",
                                                    "algorithm.name=heterofl", "--set", "clients.models=cnn4@1,myplug:make"]))
    assert "clients.models" in line and "not width-sliceable" in line and "myplug:make" in line
    assert not out.exists()
    prof = yaml.safe_load(open("profiles/pi4.yaml"))
    prof["name"], prof["budgets"] = "tiny-mcu", {"macs_m": 0.001}
    (tmp_path / "tiny-mcu.yaml").write_text(yaml.safe_dump(prof))
    line = _one_error_line(CliRunner().invoke(cli, [*base, "--out", str(out), "--set", "algorithm.name=uniform",
                                                    "--set", f"clients.profiles=[pi4, {tmp_path / 'tiny-mcu.yaml'}]"]))
    assert "tiny-mcu" in line and "macs_m" in line
    assert not out.exists() or not any(out.iterdir())


def test_uniform_takes_the_subnet_that_fits_every_profile(tiny):
    space, *_ = tiny
    small, large = space.smallest(), space.largest()
    from rafl.search.cost import CostModel

    tight = load_profile("pi4")
    limit = (CostModel(space, tight).cost(small).macs_m + CostModel(space, tight).cost(large).macs_m) / 2
    tight = tight.with_budgets({"macs_m": limit})
    roomy = load_profile("phone").with_budgets({"macs_m": 1000.0})
    arch_of = {"pi4": {"arch": small, "search_accuracy": 0.5}, "phone": {"arch": large, "search_accuracy": 0.9}}
    one = uniform_arch(space, arch_of, [tight, roomy])
    assert one["arch"] == small and "pi4" in one["source"]
    with pytest.raises(UserInputError, match="no searched subnet meets every profile"):
        uniform_arch(space, {"phone": arch_of["phone"]}, [tight, roomy])


def test_uniform_on_a_model_group_gives_everyone_the_smallest_member(tiny):
    _, _, ds, part = tiny
    _, table = build_group_federation(ds, part, SLICED, get_algorithm("uniform")(), feature_dim=16)
    # 3 clients get cnn4@1, @0.5, @0.25 round-robin: the weakest device in the federation runs @0.25
    assert {row["model"] for row in table} == {"cnn4@0.25"}


@pytest.mark.slow
def test_federated_supernet_is_saved_and_searchable(tmp_path, tiny_supernet):
    from rafl.supernet import load_supernet

    path, space = tiny_supernet
    out = tmp_path / "runs"
    res = CliRunner().invoke(cli, ["federate", "--no-progress", "--out", str(out), "--set", "name=h",
                                   "--set", f"supernet.path={path}", "--set", "data.limit_per_class=10",
                                   "--set", "clients.n=3", "--set", "algorithm.name=heterofl",
                                   "--set", "algorithm.local_epochs=1", "--set", "engine.rounds=1",
                                   "--set", f"clients.arch={space.smallest().to_string()}"])
    assert res.exit_code == 0, res.output
    run_dir = out / "h"
    net = load_supernet(run_dir)
    ck = load_state(run_dir / CHECKPOINT)
    assert all(torch.equal(v, ck["server_state"]["global"][k]) for k, v in net.state_dict().items())
    meta = json.loads((run_dir / "supernet.json").read_text())
    assert meta["metrics"]["federated"]["algorithm"] == "heterofl" and meta["metrics"]["federated"]["rounds"] == 1
    assert meta["config"] == json.loads((path / "supernet.json").read_text())["config"]
    np.testing.assert_equal(len(ck["server_state"]["global"]), len(build_supernet(space).state_dict()))


@pytest.mark.slow
def test_compare_of_nas_subnets_reports_accuracy_per_device_tier(tmp_path, tiny_supernet):
    path, space = tiny_supernet
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--no-progress", "--models", "nas", "--out", str(out),
                                   "--algorithms", "standalone,heterofl", "--set", f"supernet.path={path}",
                                   "--set", "data.limit_per_class=10", "--set", "clients.n=4",
                                   "--set", "clients.profiles=[pi4, phone]", "--set", "algorithm.local_epochs=1",
                                   "--set", "engine.rounds=2", "--set", "search.method=largest-feasible",
                                   "--set", "search.samples=50"])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "compare.json").read_text())["rows"]
    table = json.loads((out / "heterofl" / "clients.json").read_text())["clients"]
    assert [r["algorithm"] for r in rows] == ["standalone", "heterofl", "heterofl-ft"]
    rows = [r for r in rows if "finetuned_from" not in r]  # the fine-tuned row has no run dir of its own
    for row in rows:
        summary = json.loads((out / row["algorithm"] / "summary.json").read_text())
        assert set(row["tiers"]) == {"pi4", "phone"}
        for prof, tier in row["tiers"].items():  # the tier's clients' accuracies, recomputed
            mine = [summary["clients"][str(r["client"])] for r in table if r["profile"] == prof]
            n = sum(c["test_samples"] for c in mine)
            assert tier["test_samples"] == n and tier["clients"] == len(mine)
            assert tier["acc_pooled"] == pytest.approx(sum(c["model.acc"] * c["test_samples"] for c in mine) / n)
            assert tier["se"] == pytest.approx(np.sqrt(tier["acc_pooled"] * (1 - tier["acc_pooled"]) / n))
        pooled = sum(t["acc_pooled"] * t["test_samples"] for t in row["tiers"].values()) / \
            sum(t["test_samples"] for t in row["tiers"].values())
        assert pooled == pytest.approx(row["model.acc_pooled"])
        history = [json.loads(x) for x in (out / row["algorithm"] / "metrics.jsonl").read_text().splitlines()]
        assert row["mb_up_per_client_round"] == pytest.approx(sum(r["bytes_up"] for r in history) / 1e6
                                                              / sum(r["participated"] for r in history))
        for prof, sub in row["subnets"].items():  # the budgets the tier's subnet meets on its device
            assert sub["budgets"]["fits"] and {u["budget"] for u in sub["budgets"]["use"]} >= {"macs_m"}
            assert all(u["value"] <= u["limit"] for u in sub["budgets"]["use"])
    text = (out / "compare.md").read_text()
    assert "Per device tier" in text and "| pi4 (n) | phone (n) |" in text and "binding budget" in text
    assert (out / "compare_curve.png").stat().st_size > 1000
    # heterofl's global model is kept as a searchable supernet, as rafl federate keeps it
    assert (out / "heterofl" / "supernet.safetensors").is_file() and not (out / "standalone" / "supernet.json").exists()
    header = (out / "compare.csv").read_text().splitlines()[0].split(",")
    assert "tier.pi4.acc_pooled" in header and "subnet.phone" in header


def test_tier_figures_cover_the_clients_every_method_evaluated(tmp_path):
    from rafl.reports.compare import common_client_tiers, tier_tables

    table = [{"client": c, "profile": p} for c, p in enumerate(["pi4", "phone", "pi4", "phone"])]
    full = {str(c): {"model.acc": a, "test_samples": n} for c, a, n in [(0, 0.5, 10), (1, 1.0, 20), (2, 0.0, 10),
                                                                        (3, 0.75, 40)]}
    shared = {k: v for k, v in full.items() if k != "3"}  # client 3 never trained: no per-client figure
    rows = []
    for name, clients in (("fedgh", full), ("rafl", shared)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"clients": clients}))
        rows.append({"algorithm": name, "tiers": {"pi4": {}}})
    common_client_tiers(rows, tmp_path, table)
    for r in rows:
        assert r["clients_left_out"] == ["3"] and r["tier_clients"] == 3
        assert r["tiers"]["pi4"]["acc_pooled"] == 0.25 and r["tiers"]["phone"]["test_samples"] == 20
        assert r["tiers_overall"]["acc_pooled"] == pytest.approx((5 + 20 + 0) / 40)
    assert "left out: client(s) 3" in "\n".join(tier_tables(rows))
