"""Payloads, aggregation (RaFL Eq. 7), DML losses (Eqs. 3-6), registry and run config."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rafl.config import parse_overrides
from rafl.errors import UserInputError
from rafl.federation.aggregation import payload_weights, weighted_average
from rafl.federation.algorithms import ALGORITHMS, get_algorithm
from rafl.federation.losses import dml_losses, kl_soft
from rafl.federation.payload import Payload
from rafl.federation.run_config import load_run_config
from rafl.federation.training import train_mutual as train_dml


# ---------------------------------------------------------------------- payload
def test_payload_nbytes_is_safetensors_size_and_round_trips():
    t = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(4, dtype=torch.float16)}
    p = Payload(t, {"n_samples": 12, "class_ids": [0, 3, 7]})
    blob = p.to_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + header_len])
    # exact count: 8-byte length + JSON header + raw tensor bytes (6*4 + 4*2)
    assert p.nbytes() == len(blob) == 8 + header_len + 24 + 8
    assert json.loads(header["__metadata__"]["rafl"]) == {"class_ids": [0, 3, 7], "n_samples": 12}
    q = Payload.from_bytes(blob)
    assert q.meta == p.meta
    assert torch.equal(q.tensors["w"], t["w"]) and q.tensors["b"].dtype == torch.float16
    assert Payload().nbytes() == 0  # nothing sent


def test_payload_bytes_grow_with_tensor_size():
    for n in (10, 1010, 100_000):
        p = Payload({"x": torch.zeros(n)})
        blob = p.to_bytes()
        header_len = int.from_bytes(blob[:8], "little")
        assert p.nbytes() == 8 + header_len + 4 * n and header_len < 200


def test_payload_validation_names_client_and_tensor():
    ok = Payload({"a": torch.ones(2, 3)}, {"n_samples": 3})
    assert ok.validate({"a": (2, 3)}, sender="client 4") is ok
    with pytest.raises(UserInputError, match=r"client 4.*a.*NaN"):
        Payload({"a": torch.tensor([1.0, float("nan")])}).validate(sender="client 4")
    with pytest.raises(UserInputError, match=r"client 2.*a.*shape \[2, 2\].*\[2, 3\]"):
        Payload({"a": torch.ones(2, 2)}).validate({"a": (2, 3)}, sender="client 2")
    with pytest.raises(UserInputError, match=r"client 1.*missing tensor"):
        Payload({"b": torch.ones(2, 3)}).validate({"a": (2, 3), "b": (2, 3)}, sender="client 1")
    with pytest.raises(UserInputError, match=r"unexpected tensor"):
        Payload({"a": torch.ones(2, 3), "zz": torch.ones(1)}).validate({"a": (2, 3)}, sender="client 1")
    with pytest.raises(UserInputError, match="Inf"):
        Payload({"a": torch.tensor([float("inf")])}).validate(sender="client 0")
    with pytest.raises(UserInputError, match="corrupt or truncated"):
        Payload.from_bytes(ok.to_bytes()[:-5], source="client 0")
    with pytest.raises(UserInputError, match="metadata value"):
        Payload(meta={"bad": {"nested": 1}})


# ---------------------------------------------------------------------- aggregation
def test_weighted_average_is_rafl_eq7_exact():
    # theta_k = sum_l n_l / N_S theta_k^l, with n = (1, 3): weights 0.25 / 0.75
    ups = [Payload({"w": torch.tensor([[1.0, 2.0]]), "nbt": torch.tensor(4)}, {"n_samples": 1}),
           Payload({"w": torch.tensor([[5.0, -2.0]]), "nbt": torch.tensor(8)}, {"n_samples": 3})]
    w = payload_weights(ups)
    assert w == [0.25, 0.75]
    avg = weighted_average([u.tensors for u in ups], w)
    assert torch.equal(avg["w"], torch.tensor([[4.0, -1.0]]))
    assert avg["nbt"].dtype == torch.int64 and int(avg["nbt"]) == 7
    with pytest.raises(UserInputError, match="n_samples"):
        payload_weights([Payload({"w": torch.ones(1)}, {"n_samples": 0})])
    with pytest.raises(ValueError, match="shape"):
        weighted_average([{"w": torch.ones(2)}, {"w": torch.ones(3)}], [1, 1])


# ---------------------------------------------------------------------- DML
def test_dml_loss_terms_match_eqs_3_to_6():
    torch.manual_seed(0)
    logits_l = torch.randn(5, 4, requires_grad=True)
    logits_k = torch.randn(5, 4, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 0])
    loss_l, loss_k = dml_losses(logits_l, logits_k, y, temperature=1.0)
    p_l, p_k = F.softmax(logits_l, 1), F.softmax(logits_k, 1)
    kl_k_l = (p_k * (p_k.log() - p_l.log())).sum(1).mean()  # KL(p_k || p_l)
    kl_l_k = (p_l * (p_l.log() - p_k.log())).sum(1).mean()
    assert torch.allclose(loss_l, F.cross_entropy(logits_l, y) + kl_k_l, atol=1e-6)
    assert torch.allclose(loss_k, F.cross_entropy(logits_k, y) + kl_l_k, atol=1e-6)
    # each loss reaches only its own model: the partner's prediction is a constant target
    g_k = torch.autograd.grad(loss_l, logits_k, allow_unused=True)[0]
    assert g_k is None or torch.count_nonzero(g_k) == 0
    # temperature: T^2 * KL at T; identical logits -> zero KL
    assert float(kl_soft(logits_l.detach(), logits_l.detach(), 3.0)) == pytest.approx(0.0, abs=1e-6)


def test_train_dml_steps_both_models():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    a0, b0 = a.weight.detach().clone(), b.weight.detach().clone()
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(2)]
    st_a, st_b = train_dml(a, b, data, torch.optim.SGD(a.parameters(), 0.1), torch.optim.SGD(b.parameters(), 0.1))
    assert st_a.steps == st_b.steps == 2 and st_a.samples == 16
    assert not torch.equal(a.weight, a0) and not torch.equal(b.weight, b0)


# ---------------------------------------------------------------------- registry & config
def test_registry_knows_the_methods_and_rejects_unknown():
    for name in ("rafl", "standalone", "fedavg", "fedprox", "fednova", "feddf"):
        assert get_algorithm(name).name == name
    assert get_algorithm("RaFL") is ALGORITHMS["rafl"]
    with pytest.raises(UserInputError, match=r"algorithm.name.*unknown algorithm 'nope'.*rafl"):
        get_algorithm("nope")
    with pytest.raises(UserInputError, match=r"unknown hyperparameter.*'bogus'"):
        get_algorithm("rafl")(bogus=1)


def test_run_config_defaults_overrides_and_errors(tmp_path):
    cfg = load_run_config(None, ["engine.rounds=3", "algorithm.temperature=2.0", "clients.profiles=[pi4,phone]"])
    assert cfg.engine.rounds == 3 and cfg.clients.profiles == ["pi4", "phone"]
    res = cfg.resolved()
    assert res["algorithm"]["temperature"] == 2.0 and res["algorithm"]["knowledge_arch"] == "smallest"
    assert res["partition"]["public_fraction"] == 0.3 and res["partition"]["alpha"] == 0.5
    f = tmp_path / "run.yaml"
    f.write_text("engine:\n  roundz: 3\n")
    with pytest.raises(UserInputError, match=r"run.yaml: engine.roundz: unknown key; allowed: rounds"):
        load_run_config(f)
    with pytest.raises(UserInputError, match=r"engine.dropout.*allowed: a probability in \[0, 1\)"):
        load_run_config(None, ["engine.dropout=1.5"])
    with pytest.raises(UserInputError, match=r"unknown algorithm 'fedx'"):
        load_run_config(None, ["algorithm.name=fedx"])
    with pytest.raises(UserInputError, match=r"not key=value"):
        load_run_config(None, ["engine.rounds"])
    with pytest.raises(UserInputError, match=r"train.batch_size: .*allowed: an integer >= 2 \(train-mode BatchNorm"):
        load_run_config(None, ["train.batch_size=1"])
    # rafl compare's per-method sections: the selected method's applies over the shared keys
    f.write_text("algorithm:\n  name: fedtgp\n  lr: 0.05\n  tau: 3\n  fedtgp: {tau: 7}\n  fedgh: {server_lr: 0.5}\n")
    hp = load_run_config(f).algorithm.hparams()
    assert hp["tau"] == 7 and hp["lr"] == 0.05 and "server_lr" in hp and hp["server_lr"] != 0.5
    assert load_run_config(f, ["algorithm.tau=9"]).algorithm.hparams()["tau"] == 9  # the command line wins
    with pytest.raises(UserInputError, match=r"^--set: algorithm.fedtgp.tau: is -1; allowed: a number > 0"):
        load_run_config(f, ["algorithm.fedtgp.tau=-1"])
    with pytest.raises(UserInputError, match=r"^--set: algorithm.fedgh.server_lr: sets a hyperparameter of fedgh, "
                                             r"which algorithm.name does not select \(selected: fedtgp\)"):
        load_run_config(f, ["algorithm.fedgh.server_lr=0.1"])
    # an unknown key in the section is named as written, and blamed on the file (not on --set)
    f.write_text("algorithm:\n  fedtgp: {taux: 5}\n")
    with pytest.raises(UserInputError, match=r"run.yaml: algorithm.fedtgp.taux: unknown hyperparameter\(s\) \['taux'\]"):
        load_run_config(f, ["algorithm.name=fedtgp"])
    # a value cut short after its colon stays text (YAML alone would make it {pkg.mod: null});
    # a real mapping still parses as one
    assert parse_overrides(["clients.models=pkg.mod:", "clients.budgets={phone: {latency_ms: 1}}"]) == \
        [("clients.models", "pkg.mod:"), ("clients.budgets", {"phone": {"latency_ms": 1}})]


def test_feddf_sends_each_client_only_its_architecture_group():
    from rafl.federation.algorithms.base import ClientInfo
    from rafl.federation.algorithms.feddf import FedDF, group_of

    a, b = ClientInfo(0, "pi4", None, "arch-a", 10), ClientInfo(1, "phone", None, "arch-b", 10)
    groups = {group_of("arch-a"): {"w": torch.zeros(100)}, group_of("arch-b"): {"w": torch.ones(3)}}
    bcast = FedDF._broadcast(groups)
    down_a, down_b = FedDF().client_broadcast(bcast, a), FedDF().client_broadcast(bcast, b)
    assert set(down_a.tensors) == {"w"} and down_a.tensors["w"].shape == (100,)
    assert torch.equal(down_b.tensors["w"], torch.ones(3))
    assert down_b.nbytes() < down_a.nbytes() < bcast.nbytes()  # bytes counted per client download


def test_fednova_normalizer_matches_wang_et_al():
    from rafl.federation.algorithms.fedavg import _a_norm

    assert _a_norm(5, 0.0) == 5.0  # plain SGD: ||a||_1 = tau
    rho, tau = 0.9, 4  # momentum: sum_k (1 - rho^k) / (1 - rho) for k = 1..tau
    assert _a_norm(tau, rho) == pytest.approx(sum((1 - rho**k) / (1 - rho) for k in range(1, tau + 1)))


def test_client_state_round_trips_through_safetensors(tmp_path):
    from rafl.federation.store import ClientStore, load_state, save_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    state = {"local": model.state_dict(), "opt": opt.state_dict(), "round": 3, "names": ["a", "b"],
             "pair": (1.5, None)}
    save_state(tmp_path / "s.st", state)
    back = load_state(tmp_path / "s.st")
    assert torch.equal(back["local"]["weight"], model.weight) and back["round"] == 3
    assert back["names"] == ["a", "b"] and back["pair"] == (1.5, None)
    assert torch.equal(back["opt"]["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    (tmp_path / "bad.st").write_bytes((tmp_path / "s.st").read_bytes()[:-10])
    with pytest.raises(UserInputError, match="cannot load state"):
        load_state(tmp_path / "bad.st")
    with pytest.raises(TypeError, match="not Linear"):
        save_state(tmp_path / "x.st", {"model": model})
    store = ClientStore(tmp_path / "clients")
    store.save(4, 1, {"w": torch.ones(1)})
    assert not store.has(4)  # pending until the checkpoint commits it
    store.commit()
    store.save(4, 2, {"w": torch.zeros(1)})  # a crash here leaves round 1 as the committed version
    store.cleanup()
    assert float(store.load(4)["w"]) == 1.0 and [p.name for p in (tmp_path / "clients").iterdir()] == ["0000004.r00001.st"]


def test_budget_overrides_validated_and_applied():
    from rafl.search.profile import load_profile

    pi4 = load_profile("pi4")
    tight = pi4.with_budgets({"latency_ms": 1.2, "macs_m": None}, source="clients.budgets.pi4")
    assert tight.budgets.latency_ms == 1.2 and tight.budgets.macs_m is None
    assert tight.throughput_gmacs == pi4.throughput_gmacs and tight.budgets.energy_mj == pi4.budgets.energy_mj
    with pytest.raises(UserInputError, match=r"clients.budgets.pi4.*latency_msec"):
        pi4.with_budgets({"latency_msec": 1.0}, source="clients.budgets.pi4")
    with pytest.raises(UserInputError, match=r"latency_ms"):
        pi4.with_budgets({"latency_ms": -1.0}, source="clients.budgets.pi4")
    cfg = load_run_config(None, ["clients.budgets={phone: {latency_ms: 0.3}}"])
    assert cfg.clients.budgets == {"phone": {"latency_ms": 0.3}}
    assert load_run_config(None, []).clients.budgets == {}  # no silent override: the profiles' own budgets


def test_training_keeps_a_trailing_single_sample():
    """A small trailing batch joins the previous one (BatchNorm), no sample is dropped."""
    from rafl.federation.training import no_singleton_batches, train_ce

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 3))
    x, y = torch.randn(5, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1])
    loader = [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train_ce(model, loader, opt, epochs=1)
    assert stats.samples == 5 and stats.steps == 2   # batches 2, 2+1 (batch size 2 < MIN_BATCH)
    big = [(torch.randn(8, 1, 2, 2), torch.arange(8) % 3), (x[:2], y[:2])]
    assert [len(b[1]) for b in no_singleton_batches(big)] == [10]
    assert [len(b[1]) for b in no_singleton_batches(big[:1] + big[:1])] == [8, 8]
    assert [len(b[1]) for b in no_singleton_batches([(x[:1], y[:1])])] == [2]


@pytest.mark.parametrize("key,value,ok", [
    ("lr", "1e-3", 0.001), ("lr", 5, 5.0), ("local_epochs", 2.0, 2), ("distill", True, True),
    ("lr", "abc", None), ("lr", -1, None), ("lr", float("nan"), None), ("local_epochs", 0, None),
    ("local_epochs", 1.5, None), ("temperature", 0, None), ("momentum", 1.0, None), ("distill", "yes", None),
])
def test_hyperparameters_are_typed_and_range_checked(key, value, ok):
    algo_cls = get_algorithm("rafl")
    if ok is None:
        with pytest.raises(UserInputError, match=rf"algorithm\.{key}: is .*allowed"):
            algo_cls(**{key: value})
    else:
        hp = algo_cls(**{key: value}).hparams[key]
        assert hp == ok and type(hp) is type(ok)


def test_rafl_knowledge_width_is_range_checked():
    algo = get_algorithm("rafl")
    assert algo().hparams["knowledge_width"] == 0.375 and algo(knowledge_width=1).hparams["knowledge_width"] == 1.0
    for bad in (0, 1.5, "x"):
        with pytest.raises(UserInputError, match=r"algorithm\.knowledge_width"):
            algo(knowledge_width=bad)


def test_bn_recalibration_matches_the_data_statistics_of_the_final_weights():
    from rafl.federation.training import recalibrate_local_bn as recalibrate_bn
    from rafl.federation.training import train_ce

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x = torch.randn(20, 3, 8, 8) * 3 + 1
    loader = [(x[i:i + 6], torch.zeros(len(x[i:i + 6]), dtype=torch.long)) for i in range(0, 20, 6)]  # 6,6,6,2
    bn = model[1]
    bn.running_mean.fill_(50.0)  # stale statistics
    bn.running_var.fill_(1e-4)
    assert recalibrate_bn(model, loader) == 3  # the batch of 2 joins the one before it
    conv = model[0](x).detach()
    per_batch = [x[:6], x[6:12], x[12:]]  # batches as recalibrated (the last two merged)
    means = torch.stack([model[0](b).mean(dim=(0, 2, 3)) for b in per_batch]).detach()
    assert torch.allclose(bn.running_mean, means.mean(0), atol=1e-5)  # cumulative average over the pass
    assert bn.momentum == 0.1 and model.training
    assert conv.mean(dim=(0, 2, 3)).sub(bn.running_mean).abs().max() < 0.5
    # no data: statistics untouched; no BatchNorm: nothing to do
    before = bn.running_mean.clone()
    assert recalibrate_bn(model, []) == 0 and torch.equal(bn.running_mean, before)
    assert recalibrate_bn(torch.nn.Linear(3, 3), loader) == 0
    # the local training loop ends with it (running stats follow the final weights, not the EMA)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    train_ce(model, loader, opt, epochs=1)
    after_train = bn.running_mean.clone()
    recalibrate_bn(model, loader)
    assert torch.allclose(after_train, bn.running_mean, atol=1e-6)
    # FedAvg-style training (the whole model is averaged) keeps the running estimates
    bn.running_mean.fill_(50.0)
    train_ce(model, loader, opt, epochs=1, bn_recalibration=False)
    assert bn.running_mean.min() > 30                   # EMA of 3 steps from 50 (0.9^3 = 0.73)


class _FeatHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.features(x))


@pytest.mark.parametrize("trainer", ["dml", "mutual"])
def test_dml_recalibrates_the_private_model_only(trainer):
    """RaFL's knowledge network / FML's meme model are averaged with their BN statistics on the
    server: only the specialized (private) model is recalibrated after local training."""
    from rafl.federation.training import train_mutual
    from rafl.federation.training import train_mutual as train_dml

    torch.manual_seed(0)
    a, b = _FeatHead(), _FeatHead()
    for m in (a, b):
        m.features[1].running_mean.fill_(50.0)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    fn = train_dml if trainer == "dml" else train_mutual
    fn(a, b, data, torch.optim.SGD(a.parameters(), 0.01), torch.optim.SGD(b.parameters(), 0.01))
    assert a.features[1].running_mean.abs().max() < 5      # recalibrated on the data
    assert b.features[1].running_mean.min() > 30           # EMA of 3 steps from 50 (0.9^3 = 0.73)


def test_distill_kl_moves_the_student_toward_the_teacher():
    """Server-side distillation (RaFL Eq. 9, FedDF) runs end to end and lowers the KL."""
    from rafl.federation.losses import kl_soft
    from rafl.federation.training import distill_kl
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    images = torch.randn(40, 6)
    teacher = torch.randn(40, 3) * 3
    student.eval()
    before = float(kl_soft(student(images), teacher))
    st = distill_kl(student, images, teacher, torch.optim.Adam(student.parameters(), 1e-2), epochs=20,
                    batch_size=8, generator=torch.Generator().manual_seed(0))
    student.eval()
    assert st.steps == 100 and st.samples == 800
    assert float(kl_soft(student(images), teacher)) < 0.75 * before
    with pytest.raises(ValueError, match="40 images but 3 teacher logits"):
        distill_kl(student, images, teacher[:3], torch.optim.Adam(student.parameters(), 1e-2))


def test_evaluate_header_rules_shares_one_extractor_pass_and_restores_modes():
    """Each rule is argmax(header(features) + offset); the extractor runs once per batch; every
    module's train/eval mode comes back as it was."""
    from rafl.federation.training import evaluate_header_rules

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
            self.head = torch.nn.Linear(3, 2)
            self.calls = 0

        def features(self, x):
            self.calls += 1
            return self.body(x)

    torch.manual_seed(0)
    model, other = Split(), torch.nn.Linear(3, 2)
    model.train(), other.eval()
    x, y = torch.randn(10, 4), torch.tensor([0, 1] * 5)
    loader = [(x[:6], y[:6]), (x[6:], y[6:])]
    offset = torch.tensor([5.0, -5.0])                    # forces class 0
    acc = evaluate_header_rules(model, loader, {"own": (model.head, None), "shifted": (model.head, offset),
                                                "other": (other, None)})
    with torch.no_grad():
        feats = model.body.eval()(x)
    model.body.train()
    assert acc["own"] == (int((model.head(feats).argmax(1) == y).sum()), 10)
    assert acc["other"] == (int((other(feats).argmax(1) == y).sum()), 10)
    assert acc["shifted"] == (5, 10)
    assert model.calls == 2                                # one extractor pass per batch
    assert model.training and model.body[1].training and not other.training


def test_a_model_group_trains_at_its_own_default_lr_unless_one_is_given(tmp_path):
    """NAS subnets fine-tune at SUBNET_LR; a model group (trained from scratch, cnn3-small
    without BatchNorm) at GROUP_LR, which it did not diverge at; an lr the user gives always wins
    (rafl federate and rafl compare alike)."""
    from rafl.federation.algorithms.hparams import GROUP_LR, SUBNET_LR, LocalTraining
    from rafl.federation.run_config import load_run_config
    from rafl.stages.compare import load_compare_config

    assert LocalTraining.defaults()["lr"] == SUBNET_LR
    assert load_run_config(None, ["algorithm.name=fd"]).algorithm.hparams()["lr"] == SUBNET_LR
    group = ["algorithm.name=fd", "clients.models=htfe-tiny"]
    assert load_run_config(None, group).algorithm.hparams()["lr"] == GROUP_LR != SUBNET_LR
    assert load_run_config(None, [*group, "algorithm.lr=0.05"]).algorithm.hparams()["lr"] == 0.05
    f = tmp_path / "run.yaml"
    f.write_text("algorithm: {name: fd, fd: {lr: 0.03}}\nclients: {models: htfe-tiny}\n")
    assert load_run_config(f).algorithm.hparams()["lr"] == 0.03  # the method's own section counts as given
    _, hps = load_compare_config(None, ["algorithm.fd.lr=0.03"], ["fd", "standalone"])  # default models: a group
    assert hps["fd"]["lr"] == 0.03 and hps["standalone"]["lr"] == GROUP_LR
    _, hps = load_compare_config(None, [], ["fd", "standalone"], "nas")
    assert hps["fd"]["lr"] == hps["standalone"]["lr"] == SUBNET_LR
    _, hps = load_compare_config(None, ["clients.models=nas"], ["fd"])  # the config's models, when --models is not given
    assert hps["fd"]["lr"] == SUBNET_LR


def test_a_model_group_carves_no_public_pool_that_nothing_uses():
    """The default public_fraction (0.3) feeds the supernet's training, search and BN recalibration:
    a model group with methods that do not distil on the pool keeps all data for its clients."""
    from rafl.federation.run_config import load_run_config
    from rafl.stages.compare import load_compare_config

    group = ["clients.models=htfe-tiny"]
    assert load_run_config(None, [*group, "algorithm.name=fedgh"]).partition.public_fraction == 0.0
    assert load_run_config(None, ["algorithm.name=fedgh"]).partition.public_fraction == 0.3  # nas
    assert load_run_config(None, [*group, "algorithm.name=feddf"]).partition.public_fraction == 0.3  # distils on it
    assert load_run_config(None, [*group, "algorithm.name=rafl", "algorithm.distill=true"]).partition.public_fraction == 0.3
    assert load_run_config(None, [*group, "algorithm.name=fedgh", "partition.public_fraction=0.2"]
                           ).partition.public_fraction == 0.2  # given: kept
    assert load_compare_config(None, [], ["fedgh", "fd"])[0].partition.public_fraction == 0.0
    assert load_compare_config(None, [], ["fedgh", "feddf"])[0].partition.public_fraction == 0.3
    assert load_compare_config(None, [], ["fedgh"], "nas")[0].partition.public_fraction == 0.3
