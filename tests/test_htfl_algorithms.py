"""Every HtFL method runs 2 rounds on tiny real data (digits) with heterogeneous models; edge cases."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rafl.data import ClientSplit, Partition, load_dataset
from rafl.errors import UserInputError
from rafl.federation.algorithms import ClientContext, ClientInfo, ServerContext, get_algorithm
from rafl.federation.build import build_group_federation
from rafl.federation.engine import Engine, EngineConfig
from rafl.federation.payload import Payload
from rafl.federation.runners import Federation
from rafl.reports.run import RunReport

MODELS = ["cnn4-small", "cnn3-small"]
D = 16
FAST = {"fedtgp": {"server_epochs": 3}}
HTFL = ["fedgh", "fedtgp", "fedproto", "lg-fedavg", "fd", "fml", "fedkd"]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", limit_per_class=12)


def _split(idx: np.ndarray) -> ClientSplit:
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    n_test = max(1, len(idx) // 4)
    return ClientSplit(train=idx[n_test:], val=np.zeros(0, np.int64), test=idx[:n_test])


@pytest.fixture(scope="module")
def edge_partition(digits):
    """Client 0: classes 0-1; client 1: a single class (5); client 2: 3 train samples (< batch size)
    of classes 2, 3; client 3: classes 6-9 (classes 4 is held by nobody)."""
    y = digits.labels.numpy()
    by = {c: np.flatnonzero(y == c) for c in range(10)}
    c0 = np.concatenate([by[0][:8], by[1][:8]])
    c1 = by[5][:10]
    c2 = np.concatenate([by[2][:3], by[3][:1]])          # 1 test + 3 train
    c3 = np.concatenate([by[c][:5] for c in (6, 7, 8, 9)])
    return Partition(clients=[_split(c) for c in (c0, c1, c2, c3)], public=np.zeros(0, np.int64), meta={})


def _run(name, digits, part, tmp_path, rounds=2, **hp):
    algo = get_algorithm(name)(**{**FAST.get(name, {}), **hp})
    fed, _ = build_group_federation(digits, part, MODELS, algo, feature_dim=D, batch_size=8, seed=0)
    summary = Engine(fed, EngineConfig(rounds=rounds, seed=0), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    history = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, history


@pytest.mark.parametrize("name", HTFL)
def test_two_rounds_on_edge_case_clients(name, digits, edge_partition, tmp_path):
    summary, history = _run(name, digits, edge_partition, tmp_path)
    assert len(history) == 2
    last = history[-1]
    acc = last["model.acc_mean_over_clients"]
    assert 0.0 <= acc <= 1.0 and np.isfinite(acc)
    assert last["participated"] == 4 and last["bytes_up"] > 0
    if name in ("fedtgp", "fedproto"):
        assert 0.0 <= last["proto.acc_mean_over_clients"] <= 1.0     # nearest-prototype accuracy
    if name in ("fml", "fedkd"):
        assert "global.acc_mean_over_clients" in last


def test_two_rounds_deterministic(digits, edge_partition, tmp_path):
    _, h1 = _run("fedtgp", digits, edge_partition, tmp_path / "a")
    _, h2 = _run("fedtgp", digits, edge_partition, tmp_path / "b")
    keys = ["model.acc_mean_over_clients", "proto.acc_mean_over_clients", "bytes_up", "bytes_down"]
    assert [[r[k] for k in keys] for r in h1] == [[r[k] for k in keys] for r in h2]


def _ctx(fed: Federation, cid: int, rnd: int = 1) -> ClientContext:
    return ClientContext(info=fed.clients[cid], make_model=lambda arch=None: fed.client_model(cid, arch),
                         train_loader=fed.loaders(cid, "train", 1), val_loader=None,
                         test_loader=fed.loaders(cid, "test", 1), n_classes=fed.n_classes, round=rnd)


def test_fedgh_upload_bytes_formula_and_classes(digits, edge_partition):
    algo = get_algorithm("fedgh")()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    server_state, broadcast = algo.init_server(fed.server)
    held = {0: [0, 1], 1: [5], 2: [2, 3], 3: [6, 7, 8, 9]}
    held[2] = sorted(set(digits.labels[edge_partition.clients[2].train].tolist()))
    uploads = []
    for cid in range(4):
        ctx = _ctx(fed, cid)
        _, up = algo.client_update(algo.init_client(ctx), broadcast, ctx)
        s = len(held[cid])
        assert up.tensors["lar.labels"].tolist() == held[cid]          # absent classes: no LAR
        tensor_bits = sum(t.numel() * t.element_size() for t in up.tensors.values()) * 8
        assert tensor_bits == (s + s * D) * 32                          # (S + S*r) x 32 bits exactly
        blob = up.to_bytes()
        assert up.nbytes() == tensor_bits // 8 + 8 + int.from_bytes(blob[:8], "little")  # + safetensors header
        up.meta["client_id"] = cid
        uploads.append(up)
    new_state, new_bc = algo.server_aggregate(uploads, server_state, fed.server)
    assert not torch.equal(new_state["head"]["weight"], server_state["head"]["weight"])
    assert set(new_bc.tensors) == {"head.weight", "head.bias"}


def test_fedgh_header_replaces_local_header(digits, edge_partition):
    algo = get_algorithm("fedgh")()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    _, broadcast = algo.init_server(fed.server)
    ctx = _ctx(fed, 3)
    state, _ = algo.client_update(algo.init_client(ctx), broadcast, ctx)
    head = {k: torch.full_like(v, 0.5) for k, v in broadcast.state_dict("head.").items()}
    out = algo.prepare_evaluation(state, Payload.from_state_dict(head, "head."), ctx)
    assert torch.equal(out["model"]["head.weight"], head["weight"])


def test_fedgh_reports_the_locally_trained_header_and_can_deploy_it(digits, edge_partition):
    """prepare_evaluation puts the broadcast header in the model and keeps the header the client
    trained (local.*); deploy_header=local makes that the deployed model (model.* = local.*), and
    every rule is what evaluate_accuracy gives for a model with that header."""
    from rafl.federation.training import evaluate_accuracy

    paper, local = get_algorithm("fedgh")(), get_algorithm("fedgh")(deploy_header="local")
    fed, _ = build_group_federation(digits, edge_partition, MODELS, paper, feature_dim=D, batch_size=8, seed=0)
    _, broadcast = paper.init_server(fed.server)
    ctx = _ctx(fed, 3)                                  # classes 6-9
    torch.manual_seed(0)
    state, _ = paper.client_update(paper.init_client(ctx), broadcast, ctx)
    trained = {k[len("head."):]: v for k, v in state["model"].items() if k.startswith("head.")}
    other = {k: torch.randn_like(v) for k, v in broadcast.state_dict("head.").items()}
    ev = paper.prepare_evaluation(state, Payload.from_state_dict(other, "head."), ctx)
    assert all(torch.equal(ev["local_head"][k], v) for k, v in trained.items())
    assert torch.equal(ev["model"]["head.weight"], other["weight"])
    a, b = paper.evaluate(ev, ctx), local.evaluate(ev, ctx)
    own = ctx.make_model()
    own.load_state_dict(state["model"])
    glob = ctx.make_model()
    glob.load_state_dict(ev["model"])
    assert (a["local.correct"], a["local.total"]) == evaluate_accuracy(own, ctx.test_loader)
    assert (a["model.correct"], a["model.total"]) == evaluate_accuracy(glob, ctx.test_loader)
    assert b["model.correct"] == b["local.correct"] == a["local.correct"]
    assert paper.evaluate(state, ctx)["local.correct"] == a["local.correct"]   # no broadcast: its own header


def test_fedgh_local_label_prior_adjusts_only_the_deployed_logits(digits, edge_partition):
    """label_prior=local: logits + log((n_y + 1) / (n + K)) at evaluation (Menon et al. 2021, Eq. 4);
    the upload is unchanged, the counts come from local training (or the train split before it)."""
    from rafl.federation.algorithms.fedgh import PriorAdjusted, log_label_prior

    lp = log_label_prior(torch.tensor([3, 0, 1]))
    assert torch.allclose(lp.exp(), torch.tensor([4 / 7, 1 / 7, 2 / 7])) and torch.isfinite(lp).all()
    lin = torch.nn.Linear(2, 3)
    torch.nn.init.zeros_(lin.weight), torch.nn.init.zeros_(lin.bias)
    assert PriorAdjusted(lin, lp)(torch.ones(5, 2)).argmax(1).tolist() == [0] * 5   # flat logits -> the prior decides

    plain, adj = get_algorithm("fedgh")(), get_algorithm("fedgh")(label_prior="local")
    fed, _ = build_group_federation(digits, edge_partition, MODELS, plain, feature_dim=D, batch_size=8, seed=0)
    _, broadcast = plain.init_server(fed.server)
    ctx = _ctx(fed, 1)                                  # a single class (5): the prior says "5"
    untrained = plain.init_client(ctx)
    assert adj.evaluate(untrained, ctx)["model.correct"] == adj.evaluate(untrained, ctx)["model.total"]
    torch.manual_seed(0)
    state, up = adj.client_update(untrained, broadcast, ctx)
    torch.manual_seed(0)
    _, up_plain = plain.client_update(untrained, broadcast, ctx)
    assert state["label_counts"].tolist() == [0] * 5 + [len(edge_partition.clients[1].train)] + [0] * 4
    assert set(up.tensors) == set(up_plain.tensors) == {"lar.values", "lar.labels"}
    ev = adj.prepare_evaluation(state, broadcast, ctx)
    assert torch.equal(ev["label_counts"], state["label_counts"])
    a, p = adj.evaluate(ev, ctx), plain.evaluate(ev, ctx)
    assert a["model.correct"] == a["prior.correct"] == p["prior.correct"] >= p["model.correct"]


@pytest.mark.parametrize("mode", ["per-lar", "per-client"])
def test_fedgh_server_epochs_fit_the_header_to_the_rounds_lars(mode):
    """``server_epochs`` passes over the round's LARs: one pass at eta_theta = 0.01 (Algorithm 1,
    the default) barely moves a fresh header; 100 (HtFLlib's) fit it to every LAR's class."""
    from rafl.federation.algorithms.fedgh import train_global_header

    gen = torch.Generator().manual_seed(0)
    means = 2 * torch.randn(10, D, generator=gen)
    holds = ([0, 1], [2, 3, 4], [5, 6], [7, 8, 9], [0, 9])
    lars = [{c: means[c] + 0.1 * torch.randn(D, generator=gen) for c in cls} for cls in holds]
    x = torch.stack([v for client in lars for v in client.values()])
    y = torch.tensor([c for client in lars for c in client])

    def fit(epochs: int) -> tuple[float, float]:
        torch.manual_seed(0)
        header = torch.nn.Linear(D, 10)
        w0 = header.weight.detach().clone()
        train_global_header(header, lars, lr=0.01, epochs=epochs, mode=mode, max_grad_norm=10.0)
        with torch.no_grad():
            return float((header(x).argmax(1) == y).float().mean()), float((header.weight - w0).norm())

    acc1, moved1 = fit(1)
    acc100, moved100 = fit(100)
    assert get_algorithm("fedgh")().hparams["server_epochs"] == 1
    assert acc100 == 1.0 and acc1 < 0.8
    assert moved100 > 5 * moved1


def test_fedgh_server_clip_keeps_header_finite_with_an_outlying_lar():
    """One client's eval-mode representation with a norm in the thousands (seen with a ShuffleNetV2
    client on CIFAR-10 Dirichlet 0.1): unclipped, 100 server epochs blow the shared header up; the
    default gradient-norm clip bounds every step to lr * max_grad_norm."""
    from rafl.federation.algorithms.fedgh import train_global_header

    gen = torch.Generator().manual_seed(0)
    lars = [{c: torch.rand(D, generator=gen) * 3 for c in (0, 1, 2)},
            {3: torch.rand(D, generator=gen) * 3000, 4: -torch.rand(D, generator=gen) * 3000}]
    sizes = {}
    for clip in (0.0, 10.0):
        torch.manual_seed(0)
        header = torch.nn.Linear(D, 10)
        w0 = header.weight.detach().clone()
        train_global_header(header, lars, lr=0.01, epochs=100, mode="per-lar", max_grad_norm=clip)
        sizes[clip] = float((header.weight.detach() - w0).norm())
        assert torch.isfinite(header.weight).all()
    steps = 100 * 5
    assert sizes[10.0] <= 0.01 * 10.0 * steps + 1e-4          # every step moves the header by <= lr * clip
    assert sizes[0.0] > 10 * sizes[10.0]                       # unclipped, the outlier dominates
    assert get_algorithm("fedgh")().hparams["server_max_grad_norm"] == 10.0
    with pytest.raises(UserInputError, match="server_max_grad_norm"):
        get_algorithm("fedgh")(server_max_grad_norm=-1)


@pytest.mark.parametrize("name", ["fedgh", "lg-fedavg"])
def test_headers_of_different_shapes_are_a_clear_error_before_round_1(name, digits, edge_partition, tmp_path,
                                                                      monkeypatch):
    mod = tmp_path / "odd_models.py"
    mod.write_text(
        "import torch\nfrom torch import nn\n"
        "class Odd(nn.Module):\n"
        "    def __init__(self, n_classes, feature_dim):\n"
        "        super().__init__()\n"
        "        self.body = nn.Linear(3 * 32 * 32, feature_dim)\n"
        "        self.head = nn.Sequential(nn.Linear(feature_dim, 8), nn.ReLU(), nn.Linear(8, n_classes))\n"
        "    def features(self, x):\n"
        "        return self.body(x.flatten(1))\n"
        "    def forward(self, x):\n"
        "        return self.head(self.features(x))\n"
        "def factory(n_classes, feature_dim):\n"
        "    return Odd(n_classes, feature_dim)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = get_algorithm(name)()
    fed, _ = build_group_federation(digits, edge_partition, ["cnn4-small", "odd_models:factory"], algo,
                                    feature_dim=D, batch_size=8)
    with pytest.raises(UserInputError, match="^clients.models: .*header"):
        Engine(fed, EngineConfig(rounds=1), tmp_path / "run", progress=False,
               observers=[RunReport(tmp_path / "run")]).run()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_fedtgp_server_prototypes_only_for_uploaded_classes_and_margin(digits, edge_partition):
    algo = get_algorithm("fedtgp")(server_epochs=20, tau=100.0)
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    state, bc = algo.init_server(fed.server)
    assert bc.is_empty()                                               # round 1: no global prototypes
    ups = []
    for cid, vals in ((0, {0: torch.zeros(D), 1: torch.ones(D)}), (1, {5: 3 * torch.ones(D)})):
        from rafl.federation.prototypes import to_payload_tensors
        ups.append(Payload(to_payload_tensors(vals, "proto."), {"client_id": cid}))
    new_state, bc = algo.server_aggregate(ups, state, fed.server)
    assert bc.tensors["global.labels"].tolist() == [0, 1, 5]
    assert new_state["seen"] == [0, 1, 5] and all(type(c) is int for c in new_state["seen"])
    # averaged protos: 0 at 0, 1 at 1s, 5 at 3s: min distances 4, 4, 8 -> margin = 8 (sqrt(16*4) = 8)
    assert new_state["margin"] == pytest.approx(8.0, rel=1e-5)
    assert np.isfinite(new_state["server_loss"]) and new_state["server_loss"] > 0
    assert torch.isfinite(bc.tensors["global.values"]).all()


@pytest.mark.parametrize("name, hp, msg", [("fedtgp", {"distance": "cosine"}, "euclidean, mse"),
                                           ("fedproto", {"distance": "cosine"}, "mse, squared, euclidean"),
                                           ("fedgh", {"server_mode": "sideways"}, "per-lar, per-client"),
                                           ("fedgh", {"label_prior": "global"}, "label_prior.*none, local"),
                                           ("fedgh", {"deploy_header": "mine"}, "deploy_header.*global, local"),
                                           ("fedgh", {"label_prior": "local", "deploy_header": "local"},
                                            "label_prior.*deploy_header: local.*allowed with it: none"),
                                           # YAML turned `yes` / an empty value into True / None: say so
                                           ("fedgh", {"label_prior": True}, "is True .YAML reads yes/no.*quote"),
                                           ("fedgh", {"label_prior": None}, "is None .YAML.*~ as null.*none, local"),
                                           ("fedgh", {"server_lr_typo": 1}, "unknown hyperparameter"),
                                           # a width of 1e8 asked the allocator for 51 GB (a traceback)
                                           ("fedtgp", {"server_hidden_dim": 100_000_000},
                                            r"server_hidden_dim: is 100000000; allowed: an integer in 0..4096"),
                                           # FML Eqs. 1-2: 1 - alpha weights the KL term (it pushed away)
                                           ("fml", {"alpha": 1.5}, r"algorithm.alpha: is 1.5; allowed: a fraction in \[0, 1\]"),
                                           ("fml", {"beta": -0.5}, r"algorithm.beta: is -0.5; allowed: a number >= 0"),
                                           ("fml", {"beta": 2}, r"algorithm.beta: is 2; allowed: a fraction in \[0, 1\]"),
                                           # a negative weight switched FedKD's hidden loss off silently
                                           ("fedkd", {"hidden_weight": -1}, r"hidden_weight: is -1; allowed: a number >= 0")])
def test_bad_hyperparameters_rejected_at_construction(name, hp, msg):
    with pytest.raises(UserInputError, match=msg):
        get_algorithm(name)(**hp)


def test_fedproto_weighted_class_average_eq6(digits, edge_partition):
    algo = get_algorithm("fedproto")()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    state, _ = algo.init_server(fed.server)
    ups = [Payload({"proto.values": torch.tensor([[0.0] * D, [2.0] * D]), "proto.labels": torch.tensor([0, 3], dtype=torch.int32),
                    "proto.counts": torch.tensor([1, 5], dtype=torch.int32)}),
           Payload({"proto.values": torch.tensor([[3.0] * D]), "proto.labels": torch.tensor([0], dtype=torch.int32),
                    "proto.counts": torch.tensor([2], dtype=torch.int32)})]
    state, bc = algo.server_aggregate(ups, state, fed.server)
    assert bc.tensors["global.labels"].tolist() == [0, 3]
    assert torch.allclose(bc.tensors["global.values"][0], torch.full((D,), 2.0))   # (1*0 + 2*3) / 3
    # next round only class 3 arrives: class 0 keeps its prototype
    state, bc = algo.server_aggregate([Payload({"proto.values": torch.ones(1, D), "proto.labels": torch.tensor([3], dtype=torch.int32),
                                                "proto.counts": torch.tensor([4], dtype=torch.int32)})], state, fed.server)
    assert bc.tensors["global.labels"].tolist() == [0, 3]
    assert torch.allclose(bc.tensors["global.values"][0], torch.full((D,), 2.0))


def test_nas_subnets_federate_with_fedgh_and_fedtgp(tmp_path):
    """The same methods on resource-aware subnets of a (tiny) OFA supernet."""
    import copy

    from rafl.data import make_loader
    from rafl.supernet import build_supernet, extract_subnet, recalibrate_bn
    from rafl.supernet.arch import SearchSpace

    torch.manual_seed(0)
    ds = load_dataset("digits", limit_per_class=6)
    space = SearchSpace(width_mult=0.25, resolutions=(12,), n_classes=10)
    sup = build_supernet(space)
    import dataclasses

    small = space.smallest()   # two different (cheap) subnets: the smallest, and it with 5x5 kernels in stage 1
    archs = [small, dataclasses.replace(small, ks=(5,) * space.max_depth + small.ks[space.max_depth:])]
    assert archs[0].to_string() != archs[1].to_string()
    y = ds.labels.numpy()
    idx = [np.flatnonzero(np.isin(y, [0, 1, 2])), np.flatnonzero(np.isin(y, [2, 3, 4, 5]))]
    splits = [_split(i) for i in idx]
    calib = ds.images[torch.as_tensor(np.flatnonzero(np.isin(y, [6, 7, 8, 9])))]  # the "server's" images
    templates = {}

    def subnet(arch):  # extracted + BN-recalibrated once per arch, as the federate pipeline does
        key = arch.to_string()
        if key not in templates:
            templates[key] = extract_subnet(sup, arch)
            recalibrate_bn(templates[key], [calib], n_batches=1)
            templates[key].eval()
        return copy.deepcopy(templates[key]).train()

    infos = [ClientInfo(i, "custom", archs[i], archs[i].to_string(), len(splits[i].train)) for i in range(2)]
    for name in ("fedgh", "fedtgp"):
        algo = get_algorithm(name)(**FAST.get(name, {}), lr=0.01)
        server = ServerContext(clients=infos, make_model=lambda arch=None, client_id=0: subnet(arch or archs[client_id]),
                               public_images=None, n_classes=10, space=space)
        fed = Federation(algorithm=algo, clients=infos,
                         loaders=lambda cid, split, seed: make_loader(ds, getattr(splits[cid], split), 8,
                                                                      shuffle=split == "train", seed=seed % 2**63),
                         client_model=lambda cid, arch=None: subnet(arch or archs[cid]),
                         server=server, n_classes=10)
        summary = Engine(fed, EngineConfig(rounds=2), tmp_path / name, progress=False,
                         observers=[RunReport(tmp_path / name)]).run()
        hist = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert np.isfinite(hist[-1]["model.acc_mean_over_clients"]) and hist[-1]["bytes_up"] > 0
        assert summary["algorithm"] == name and summary["rounds"] == 2


def test_diverged_server_training_names_server_lr(digits, edge_partition):
    """FedTGP's prototype training with a huge server_lr stops with one error naming
    algorithm.server_lr (it used to surface a round later as a client's algorithm.lr divergence)."""
    from rafl.federation.prototypes import to_payload_tensors

    algo = get_algorithm("fedtgp")(server_epochs=20, server_lr=1e12)
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    state, _ = algo.init_server(fed.server)
    ups = [Payload(to_payload_tensors({0: torch.zeros(D), 1: torch.ones(D)}, "proto."), {"client_id": 0}),
           Payload(to_payload_tensors({5: 3 * torch.ones(D)}, "proto."), {"client_id": 1})]
    with pytest.raises(UserInputError, match="^algorithm.server_lr: server training of the global prototypes "
                                             "diverged"):
        algo.server_aggregate(ups, state, fed.server)
    from rafl.federation.algorithms.fedgh import train_global_header

    header = torch.nn.Linear(D, 10)
    with torch.no_grad():
        header.weight.fill_(float("inf"))
    with pytest.raises(UserInputError, match="^algorithm.server_lr: server training of the global header diverged"):
        train_global_header(header, [{0: torch.ones(D)}], lr=0.01)


def test_untrained_client_keeps_one_initial_model_whatever_the_round(digits, edge_partition, tmp_path):
    """A client not trained yet (not sampled, or failed) is built from a per-(run, client) seed:
    evaluated in round 2 and round 5 it is the same model (it used to be re-drawn every round),
    and it is the model round 1 would have built."""
    from rafl.federation.runners import client_context, load_or_init
    from rafl.federation.store import ClientStore

    algo = get_algorithm("fedproto")()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8, seed=0)
    store = ClientStore(tmp_path)
    states = [load_or_init(fed, store, client_context(fed, 3, 1, rnd))["model"] for rnd in (1, 2, 5)]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[k], states[0][k]) for k in state)
    other = load_or_init(fed, store, client_context(fed, 4, 1, 2))["model"]   # another run seed: another init
    assert not all(torch.equal(other[k], states[0][k]) for k in other)


@pytest.mark.parametrize("name", ["fd", "fedproto", "fml", "fedgh", "lg-fedavg"])
def test_a_client_with_one_training_sample_stays_finite(name, digits, tmp_path):
    """One sample has no BatchNorm statistics (variance 0 on 1x1 feature maps): its BN layers
    train in eval mode (`train_mode`), so eval-mode outputs stay finite. Before, a ShuffleNetV2
    client holding one image uploaded NaN logits in FD's round 2 (the issue's edge case of a
    client smaller than a batch, taken to one sample)."""
    y = digits.labels.numpy()
    one = np.flatnonzero(y == 3)[:2]                        # 1 test + 1 train sample
    rest = np.concatenate([np.flatnonzero(y == c)[:8] for c in (3, 4, 5)])
    part = Partition(clients=[_split(one), _split(rest)], public=np.zeros(0, np.int64), meta={})
    algo = get_algorithm(name)(**FAST.get(name, {}))
    fed, _ = build_group_federation(digits, part, ["shufflenet_v2-0.5"], algo, feature_dim=D, batch_size=8, seed=0)
    Engine(fed, EngineConfig(rounds=4, seed=0), tmp_path, progress=False, observers=[RunReport(tmp_path)]).run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["participated"] == 2 for r in rows)


def test_train_mode_freezes_batchnorm_only_for_a_single_sample():
    from torch.utils.data import DataLoader, TensorDataset

    from rafl.federation.training import recalibrate_local_bn as recalibrate_bn
    from rafl.federation.training import train_mode

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Dropout())
    for n, bn_training in ((1, False), (2, True)):
        loader = DataLoader(TensorDataset(torch.randn(n, 1, 4, 4), torch.zeros(n, dtype=torch.long)), batch_size=8)
        train_mode(model.eval(), loader)
        assert model.training and model[2].training and model[1].training is bn_training
    before = model[1].running_var.clone()
    one = DataLoader(TensorDataset(torch.randn(1, 1, 4, 4), torch.zeros(1, dtype=torch.long)), batch_size=8)
    assert recalibrate_bn(model, one) == 0 and torch.equal(model[1].running_var, before)
    # also through the wrapper FedGH and LG-FedAvg train with (a BN1d plug-in's running variance was 0)
    from rafl.federation.training import NoSingletonBatches

    assert recalibrate_bn(model, NoSingletonBatches(one)) == 0 and torch.equal(model[1].running_var, before)
    assert not train_mode(model, NoSingletonBatches(one))[1].training


@pytest.mark.parametrize("name, hp, field, also", [
    ("fedtgp", {"lambda": 1e30}, "algorithm.lambda", "algorithm.lr"),      # the raised weight, not lr
    ("fedproto", {"lambda": 1e30}, "algorithm.lambda", "algorithm.lr"),
    ("fd", {"lr": 1e9}, "algorithm.lr", "algorithm.gamma"),                 # the raised learning rate
])
def test_diverged_local_training_blames_the_raised_key(name, hp, field, also, digits, edge_partition, tmp_path):
    with pytest.raises(UserInputError) as err:
        _run(name, digits, edge_partition, tmp_path, rounds=3, **hp)
    assert err.value.field == field and f"smaller value of it or of {also}" in err.value.message, str(err.value)


# ---------------------------------------------------------------------- server steps and loss terms
class _Tiny(torch.nn.Module):
    """features (B, 4) -> (B, 3), head (B, 3) -> (B, 5): the split of every HtFL model, no BN."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.features = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.head(self.features(x))


def _kl(p_logits, q_logits):
    """KL(p || q) of softmaxes, mean over the batch, written out (not kl_soft)."""
    p, logp, logq = p_logits.softmax(1), p_logits.log_softmax(1), q_logits.log_softmax(1)
    return float((p * (logp - logq)).sum(1).mean())


@pytest.mark.parametrize("adaptive,hidden", [(False, 0.0), (True, 0.0), (True, 0.7)])
def test_train_mutual_loss_terms_and_kl_directions(adaptive, hidden):
    """FML Eqs. 1-2 and FedKD Eqs. 1-4 term by term: the private model distils KL(p_shared || p_private),
    the shared one KL(p_private || p_shared), with the adaptive scale 1/(CE_a + CE_b) and the hidden MSE."""
    from torch.nn import functional as F

    from rafl.federation.training import train_mutual

    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3, 4, 0])
    a, b = _Tiny(0), _Tiny(1)
    with torch.no_grad():
        ha, hb = a.features(x), b.features(x)
        za, zb = a.head(ha), b.head(hb)
    ce_a, ce_b = float(F.cross_entropy(za, y)), float(F.cross_entropy(zb, y))
    s = 1 / (ce_a + ce_b) if adaptive else 1.0
    alpha, beta = 0.3, 0.8
    zero = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (a, b)]  # lr 0: the losses of the given weights
    st_a, st_b = train_mutual(a, b, [(x, y)], *zero, ce_a=alpha, kl_a=1 - alpha, ce_b=beta, kl_b=1 - beta,
                              adaptive=adaptive, hidden_weight=hidden)
    mse = float(F.mse_loss(ha, hb))
    want_a = alpha * ce_a + (1 - alpha) * s * _kl(zb, za) + hidden * s * mse
    want_b = beta * ce_b + (1 - beta) * s * _kl(za, zb) + hidden * s * mse
    assert st_a.loss == pytest.approx(want_a, rel=1e-5) and st_b.loss == pytest.approx(want_b, rel=1e-5)
    swapped = alpha * ce_a + (1 - alpha) * s * _kl(za, zb) + hidden * s * mse  # the other KL direction
    assert abs(swapped - want_a) > 1e-3
    # each loss moves its own model only: with L_b = 0 (no hidden term), b keeps its weights while a trains
    b_before = {k: v.clone() for k, v in b.state_dict().items()}
    a_before = {k: v.clone() for k, v in a.state_dict().items()}
    train_mutual(a, b, [(x, y)], torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1),
                 ce_a=alpha, kl_a=1 - alpha, ce_b=0.0, kl_b=0.0, adaptive=adaptive)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in b_before.items())
    assert not all(torch.equal(v, a.state_dict()[k]) for k, v in a_before.items())
    # max_grad_norm (FedKD's clip, as HtFLlib's client): one plain SGD step moves each model by <= lr * norm
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b)]
    train_mutual(a, b, [(x, y)], torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0),
                 adaptive=adaptive, hidden_weight=hidden, max_grad_norm=1e-3)
    for m, old in zip((a, b), before):
        step = torch.cat([(m.state_dict()[k] - v).flatten() for k, v in old.items()])
        assert 0 < float(step.norm()) <= 1e-3 * (1 + 1e-4)


def test_fd_logit_regularizer_is_gamma_mse_to_the_class_mean_logits():
    """FD's term: gamma * MSE(z, bar z_y) averaged over the batch; a sample whose class has no global
    logits yet adds 0 (and still counts in the batch mean); a step on it moves z toward bar z_y."""
    from rafl.federation.losses import logit_regularizer

    targets = {0: torch.tensor([1.0, 0.0, -1.0]), 2: torch.tensor([0.0, 2.0, 0.0])}
    z = torch.tensor([[0.0, 0.0, 0.0], [5.0, 5.0, 5.0], [1.0, 1.0, 1.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    reg = logit_regularizer(targets, gamma=0.5)
    val = reg(torch.zeros(3, 2), z, y)
    want = 0.5 * (((z[0] - targets[0]) ** 2).mean() + ((z[2] - targets[2]) ** 2).mean()) / 3
    assert float(val.detach()) == pytest.approx(float(want.detach()))
    val.backward()
    assert torch.equal(z.grad[1], torch.zeros(3))  # class 1: no target, no gradient
    assert float(reg(torch.zeros(3, 2), (z - 0.5 * z.grad).detach(), y)) < float(val.detach())
    assert float(logit_regularizer({}, 1.0)(torch.zeros(3, 2), z, y).detach()) == 0.0


def test_lg_fedavg_server_averages_headers_by_samples(digits, edge_partition):
    algo = get_algorithm("lg-fedavg")()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    state, _ = algo.init_server(fed.server)
    heads = [{k: torch.full_like(v, float(i + 1)) for k, v in state["head"].items()} for i in range(2)]
    ups = [Payload.from_state_dict(h, "head.", meta={"n_samples": n}) for h, n in zip(heads, (1, 3))]
    _, bc = algo.server_aggregate(ups, state, fed.server)
    for k, v in bc.state_dict("head.").items():  # (1 * 1 + 3 * 2) / 4
        assert torch.allclose(v, torch.full_like(v, 1.75)), k


def test_fedkd_server_adds_the_weighted_mean_of_the_decompressed_updates(digits, edge_partition):
    from rafl.federation.algorithms.fedkd import compress_update

    algo = get_algorithm("fedkd")()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8)
    state, _ = algo.init_server(fed.server)
    glob = state["global"]
    g = torch.Generator().manual_seed(0)

    def delta(v):  # rank 1 for matrices and kernels, so they travel as exact SVD factors
        if not v.is_floating_point():
            return v
        if v.ndim < 2:
            return torch.randn(v.shape, generator=g)
        m = v.shape[0]
        return (torch.randn(m, 1, generator=g) @ torch.randn(1, v.numel() // m, generator=g)).reshape(v.shape)

    deltas = [{k: delta(v) for k, v in glob.items()} for _ in range(2)]
    ups = [Payload({"upd." + k: v for k, v in compress_update(d, 1.0).items()}, meta={"n_samples": n})
           for d, n in zip(deltas, (1, 3))]
    assert any(k.endswith(".u") for k in ups[0].tensors)  # some matrices travel as SVD factors
    info = fed.clients[0]
    for u in ups:
        algo.check_upload(u, state, info, 10)
    new, _ = algo.server_aggregate(ups, state, fed.server)
    for k, v in glob.items():
        if v.is_floating_point():
            assert torch.allclose(new["global"][k], v + (deltas[0][k] + 3 * deltas[1][k]) / 4, atol=1e-4), k
    # a factor missing, or of the wrong width, is named before aggregation
    k = next(k for k in ups[0].tensors if k.endswith(".v"))
    broken = Payload({n: t for n, t in ups[0].tensors.items() if n != k})
    with pytest.raises(UserInputError, match=r"is missing; allowed: .* or its SVD factors"):
        algo.check_upload(broken, state, info, 10)
    broken = Payload({**ups[0].tensors, k: torch.zeros(1, 3)})
    with pytest.raises(UserInputError, match=r"factors have shapes"):
        algo.check_upload(broken, state, info, 10)


class _LabelTamperingFedGH(get_algorithm("fedgh")):
    """Client 0 uploads a LAR for class 99 (a node running another dataset's config, say)."""

    def client_update(self, state, broadcast, client):
        state, up = super().client_update(state, broadcast, client)
        if client.client_id == 0:
            up.tensors["lar.labels"] = up.tensors["lar.labels"].clone()
            up.tensors["lar.labels"][0] = 99
        return state, up


def test_a_malformed_class_upload_is_rejected_naming_client_and_tensor(digits, edge_partition, tmp_path):
    """Before: IndexError "Target 99 is out of bounds" from the server's cross-entropy mid-round;
    now the upload is rejected with one reason and the round completes with the other clients."""
    import re

    algo = _LabelTamperingFedGH()
    fed, _ = build_group_federation(digits, edge_partition, MODELS, algo, feature_dim=D, batch_size=8, seed=0)
    summary = Engine(fed, EngineConfig(rounds=1, seed=0), tmp_path, progress=False,
                     observers=[RunReport(tmp_path)]).run()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rejected"] == 1 and summary["rejected_uploads"] == 1 and "round_failed" not in row
    assert re.match(r"payload from client 0 \(model cnn4-small\): lar.labels: has class id\(s\) \[99\]; allowed: "
                    r"0..9", row["rejected_reasons"]["0"]), row["rejected_reasons"]


def test_a_header_blown_up_by_the_server_blames_server_lr(digits, edge_partition, tmp_path):
    """FedGH's server step with a huge server_lr and no clipping: the clients' next local training
    diverges from the header, and the error names algorithm.server_lr, not the clients' lr."""
    with pytest.raises(UserInputError, match=r"algorithm.server_lr: local training diverged .* from a global header "
                                             r"with weights up to .*allowed: a smaller algorithm.server_lr, or "
                                             r"algorithm.server_max_grad_norm > 0"):
        _run("fedgh", digits, edge_partition, tmp_path, rounds=3, server_lr=1e9, server_max_grad_norm=0.0)
