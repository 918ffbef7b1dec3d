"""Prototype building blocks of the HtFL family: LARs, wire format, distances, adaptive margin."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from rafl.errors import UserInputError
from rafl.federation.algorithms.fedgh import train_global_header
from rafl.federation.algorithms.fedkd import compress_update, decompress_update, svd_rank
from rafl.federation.algorithms.fedtgp import margin_contrastive_loss
from rafl.federation.headers import load_head
from rafl.federation.losses import prototype_regularizer
from rafl.federation.payload import Payload
from rafl.federation.prototypes import (
    adaptive_margin,
    class_averages,
    class_sums,
    from_payload,
    local_class_averages,
    nearest_prototype,
    pairwise_distances,
    payload_tensor_bits,
    safe_distance,
    to_payload_tensors,
    weighted_class_average,
)


def test_lar_exact_on_hand_made_tensors():
    feats = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0], [5.0, 6.0]])
    labels = torch.tensor([0, 0, 3, 0])
    lars = class_averages(feats, labels, n_classes=5)
    assert sorted(lars) == [0, 3]                       # absent classes 1, 2, 4: no LAR
    assert all(type(k) is int for k in lars)            # plain int keys, not tensors
    assert torch.equal(lars[0], torch.tensor([3.0, 4.0]))
    assert torch.equal(lars[3], torch.tensor([10.0, 0.0]))
    # a running sum over batches gives the same as one pass
    s, c = class_sums(feats[:1], labels[:1], 5)
    s, c = class_sums(feats[1:], labels[1:], 5, s, c)
    assert c.tolist() == [3, 0, 0, 1, 0]
    assert torch.allclose(s[0] / 3, lars[0].double())


def test_lar_from_model_counts_every_sample_of_a_small_client():
    class Ident(nn.Module):
        head = nn.Identity()

        def features(self, x):
            return x.flatten(1)

    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    y = torch.tensor([1, 1, 1])                         # single-class client, 3 samples < batch size 32
    lars, counts = local_class_averages(Ident(), [(x, y)], n_classes=4)
    assert counts == {1: 3}
    assert torch.equal(lars[1], torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError):
        class_sums(x, torch.tensor([0, 1, 7]), 4)


def test_upload_bytes_match_fedgh_formula_and_roundtrip():
    lars = {2: torch.randn(16), 7: torch.randn(16), 9: torch.randn(16)}
    tensors = to_payload_tensors(lars, "lar.")
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert tensor_bytes * 8 == payload_tensor_bits(3, 16) == (3 + 3 * 16) * 32
    blob = Payload(tensors).to_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    assert len(blob) == 8 + header_len + tensor_bytes    # overhead = safetensors header only
    header = json.loads(blob[8:8 + header_len])
    assert set(header) == {"lar.values", "lar.labels", "__metadata__"}
    back = from_payload(Payload.from_bytes(blob).tensors, "lar.")
    assert sorted(back) == [2, 7, 9] and all(type(k) is int for k in back)
    assert torch.equal(back[7], lars[7])
    empty = to_payload_tensors({}, "lar.")
    assert empty["lar.values"].numel() == 0 and from_payload(empty, "lar.") == {}


def test_adaptive_margin_on_hand_made_prototypes():
    protos = {0: torch.tensor([0.0, 0.0]), 1: torch.tensor([3.0, 0.0]), 4: torch.tensor([0.0, 4.0])}
    # min distances to other classes: class 0 -> 3, class 1 -> 3, class 4 -> 4; max = 4
    assert adaptive_margin(protos, tau=100.0) == pytest.approx(4.0)
    assert adaptive_margin(protos, tau=2.5) == pytest.approx(2.5)      # capped by tau
    assert adaptive_margin({3: torch.zeros(2)}, tau=100.0) == 0.0       # one class: no margin
    assert adaptive_margin({}, tau=100.0) == 0.0


def test_distances_have_finite_gradients_at_zero():
    a = torch.zeros(2, 5, requires_grad=True)
    d = safe_distance(a, torch.zeros(2, 5))
    d.sum().backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(d).all()
    x = torch.ones(3, 4, requires_grad=True)
    pairwise_distances(x, x.detach()).sum().backward()
    assert torch.isfinite(x.grad).all()
    # euclidean prototype loss with a representation equal to its prototype
    feats = torch.zeros(2, 3, requires_grad=True)
    reg = prototype_regularizer({0: torch.zeros(3)}, lam=0.1, distance="euclidean")
    loss = reg(feats, torch.zeros(2, 2), torch.tensor([0, 0]))
    loss.backward()
    assert torch.isfinite(feats.grad).all() and float(loss.detach()) < 1e-6
    # FedTGP's server loss with a client prototype equal to a global one
    g = torch.zeros(3, 4, requires_grad=True)
    loss = margin_contrastive_loss(torch.zeros(1, 4), torch.tensor([1]), g, margin=2.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(g.grad).all()


def test_prototype_regularizer_skips_classes_without_prototype():
    feats = torch.tensor([[1.0, 1.0], [5.0, 5.0]], requires_grad=True)
    reg = prototype_regularizer({0: torch.zeros(2)}, lam=1.0, distance="squared")
    loss = reg(feats, torch.zeros(2, 3), torch.tensor([0, 2]))   # class 2 has no prototype
    assert float(loss.detach()) == pytest.approx(2.0 / 2)                # (1^2 + 1^2) over a batch of 2
    loss.backward()
    assert feats.grad[1].abs().sum() == 0
    with pytest.raises(ValueError):
        prototype_regularizer({}, 1.0, "cosine")


def test_margin_loss_prefers_own_class_and_margin_increases_it():
    g = torch.tensor([[0.0, 0.0], [4.0, 0.0]])
    p = torch.tensor([[0.5, 0.0]])
    y = torch.tensor([0])
    l0 = margin_contrastive_loss(p, y, g, margin=0.0)
    l1 = margin_contrastive_loss(p, y, g, margin=1.0)
    assert float(l0) < float(margin_contrastive_loss(p, torch.tensor([1]), g, 0.0))
    assert float(l1) > float(l0)


def test_prototype_accuracy_without_prototypes_is_not_measured():
    """No global prototype yet (every client failed so far): (0, 0), so the round reports no
    proto accuracy instead of 0."""
    from rafl.federation.engine import summarize_eval
    from rafl.federation.prototypes import evaluate_prototype_accuracy

    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    model.features = model.forward
    loader = [(torch.zeros(3, 4), torch.tensor([0, 1, 1]))]
    assert evaluate_prototype_accuracy(model, loader, {}) == (0, 0)
    assert evaluate_prototype_accuracy(model, loader, {1: torch.zeros(2)}) == (2, 3)
    summary = summarize_eval({0: {"model.correct": 1.0, "model.total": 3.0, "proto.correct": 0.0, "proto.total": 0.0}})
    assert list(summary.accuracies) == ["model"]
    row = summary.as_row()
    assert "model.acc_mean_over_clients" in row and not any(k.startswith("proto.") for k in row)


def test_nearest_prototype_and_weighted_average():
    protos = {1: torch.tensor([0.0, 0.0]), 6: torch.tensor([10.0, 10.0])}
    pred = nearest_prototype(torch.tensor([[1.0, 0.0], [9.0, 9.0]]), protos)
    assert pred.tolist() == [1, 6]
    avg = weighted_class_average([({1: torch.tensor([0.0]), 2: torch.tensor([4.0])}, {1: 1, 2: 3}),
                                  ({1: torch.tensor([3.0])}, {1: 2})])
    assert sorted(avg) == [1, 2]
    assert float(avg[1]) == pytest.approx(2.0) and float(avg[2]) == pytest.approx(4.0)


@pytest.mark.parametrize("mode", ["per-lar", "per-client"])
def test_global_header_learns_lars(mode):
    torch.manual_seed(0)
    head = nn.Linear(4, 3)
    lars = [{0: torch.tensor([2.0, 0, 0, 0]), 2: torch.tensor([0, 0, 2.0, 0])},
            {1: torch.tensor([0, 2.0, 0, 0])}, {}]           # the third client holds nothing
    first = train_global_header(head, lars, lr=0.5, epochs=1, mode=mode)
    last = train_global_header(head, lars, lr=0.5, epochs=50, mode=mode)
    assert last < first
    x = torch.stack([lars[0][0], lars[1][1], lars[0][2]])
    assert head(x).argmax(1).tolist() == [0, 1, 2]
    with pytest.raises(UserInputError):
        train_global_header(head, lars, mode="sideways")


def test_per_lar_is_one_step_per_lar_in_client_order():
    lars = [{0: torch.ones(2)}, {1: -torch.ones(2)}]
    h1, h2 = nn.Linear(2, 2), nn.Linear(2, 2)
    h2.load_state_dict(h1.state_dict())
    train_global_header(h1, lars, lr=0.1, mode="per-lar")
    opt = torch.optim.SGD(h2.parameters(), lr=0.1)
    for c, v in [(0, torch.ones(2)), (1, -torch.ones(2))]:
        opt.zero_grad()
        nn.functional.cross_entropy(h2(v[None]), torch.tensor([c])).backward()
        opt.step()
    assert torch.allclose(h1.weight, h2.weight)


def test_load_head_rejects_other_shapes():
    class M(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.head = nn.Linear(d, 3)

        def features(self, x):
            return x

    with pytest.raises(UserInputError, match="does not fit"):
        load_head(M(4), M(5).head.state_dict(), "client 1 head")


def test_fedkd_svd_compression_roundtrip():
    torch.manual_seed(0)
    low_rank = torch.randn(32, 2) @ torch.randn(2, 3 * 3 * 4)
    delta = {"conv.weight": low_rank.reshape(32, 4, 3, 3), "bias": torch.randn(32), "n": torch.tensor(3)}
    comp = compress_update(delta, energy=0.999)
    assert comp["conv.weight.u"].shape == (32, 2) and "bias" in comp and "n" in comp
    back = decompress_update(comp, {k: v.shape for k, v in delta.items()})
    assert torch.allclose(back["conv.weight"], delta["conv.weight"], atol=1e-4)
    assert svd_rank(torch.tensor([3.0, 1.0, 0.0]), 0.9) == 1 and svd_rank(torch.tensor([1.0, 1.0]), 1.0) == 2


def test_singleton_batches_are_merged_and_bn_models_train():
    from rafl.federation.training import NoSingletonBatches, no_singleton_batches, train_regularized

    x, y = torch.randn(9, 3), torch.arange(9) % 2
    batches = [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]        # n % B == 1
    out = list(no_singleton_batches(batches))
    assert [len(b[1]) for b in out] == [4, 5] and torch.equal(torch.cat([b[0] for b in out]), x)
    one = list(no_singleton_batches([(x[:1], y[:1])]))                     # a one-sample client
    assert len(one) == 1 and len(one[0][1]) == 2

    class BNNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
            self.head = nn.Linear(4, 2)

        def features(self, v):
            return self.body(v)

    net = BNNet()
    stats = train_regularized(net, NoSingletonBatches(batches), torch.optim.SGD(net.parameters(), lr=0.1), epochs=2)
    assert stats.samples == 18 and stats.steps == 4


def test_check_class_upload_names_what_is_malformed():
    from rafl.federation.prototypes import check_class_upload

    ok = {"p.values": torch.ones(2, 4), "p.labels": torch.tensor([3, 1], dtype=torch.int32),
          "p.counts": torch.tensor([5, 1], dtype=torch.int32)}
    check_class_upload(ok, "p.", n_classes=10, dim=4, counts=True)
    check_class_upload({"p.values": torch.zeros(0, 0), "p.labels": torch.zeros(0, dtype=torch.int32)}, "p.",
                       n_classes=10, dim=4)  # a client that holds no class
    bad = [({**ok, "p.labels": torch.tensor([3, 3], dtype=torch.int32)}, r"p.labels: repeats class id\(s\) \[3\]"),
           ({**ok, "p.labels": torch.tensor([3, 10])}, r"p.labels: has class id\(s\) \[10\]; allowed: 0..9"),
           ({**ok, "p.labels": torch.tensor([-1, 2])}, r"p.labels: has class id\(s\) \[-1\]"),
           ({**ok, "p.labels": torch.tensor([3.0, 1.0])}, r"p.labels: is a torch.float32 tensor .* integer"),
           ({**ok, "p.values": torch.ones(2, 5)}, r"p.values: has shape \[2, 5\]; allowed: \[2, 4\]"),
           ({**ok, "p.values": torch.ones(3, 4)}, r"p.values: has shape \[3, 4\]; allowed: \[2, 4\]"),
           ({**ok, "p.counts": torch.tensor([5, 0], dtype=torch.int32)}, r"p.counts: .* allowed: \[2\] positive"),
           ({k: v for k, v in ok.items() if k != "p.counts"}, r"p.: has tensors .*allowed: exactly"),
           ({**ok, "p.extra": torch.ones(1)}, r"p.: has tensors .*allowed: exactly")]
    for tensors, msg in bad:
        with pytest.raises(UserInputError, match=msg):
            check_class_upload(tensors, "p.", n_classes=10, dim=4, counts=True)
