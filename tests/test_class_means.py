"""The prototype family's per-class means: from the last local epoch's training passes
(``class_means: last_epoch``) or from one more pass in eval mode (``eval_pass``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rafl.data import ClientSplit, Partition, load_dataset
from rafl.federation.algorithms import ClientContext, get_algorithm
from rafl.federation.build import build_group_federation
from rafl.federation.losses import prototype_regularizer
from rafl.federation.prototypes import RunningClassMeans, local_class_averages
from rafl.federation.training import train_ce

K = 3


class FrozenBN(nn.Module):
    """features: Linear -> BatchNorm1d -> ReLU (BN kept in eval mode whatever ``train()`` says);
    head: Linear."""

    def __init__(self, frozen: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, K)
        self.frozen = frozen
        with torch.no_grad():  # running statistics unlike any batch's, so a train-mode pass would differ
            self.body[1].running_mean.uniform_(-1, 1)
            self.body[1].running_var.uniform_(0.5, 2)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.body[1].eval()
        return self

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.features(x))


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 5, generator=g)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 2, 0, 1])
    # shuffled batches of 4: 4 + 4 + 5 (the trailing single sample is merged into the batch before)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))


def _train_pass_means(model, output):
    seen = RunningClassMeans(K)
    protos = {0: torch.ones(8), 2: torch.zeros(8)}  # a regularizer as in round 2 (classes 0 and 2 have targets)

    def collect(feats, logits, labels):
        seen.add(feats if output == "features" else logits, labels)

    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=5e-4)  # weights never move
    train_ce(model, _loader(), opt, epochs=2, extra=prototype_regularizer(protos, 1.0, "mse"),
             bn_recalibration=False, last_epoch=collect)
    return seen.result()


@pytest.mark.parametrize("output", ["features", "logits"])
def test_last_epoch_means_equal_the_exact_pass_when_bn_is_frozen(output):
    """BN in eval mode and the weights unchanged (learning rate 0, no recalibration): the
    training pass's per-class means are the eval pass's, every sample counted once."""
    model = FrozenBN()
    means, counts = _train_pass_means(model, output)
    exact, exact_counts = local_class_averages(model, _loader(), K, output=output)
    assert counts == exact_counts == {0: 5, 1: 4, 2: 4}
    assert sorted(means) == sorted(exact) == [0, 1, 2]
    for c in exact:
        torch.testing.assert_close(means[c], exact[c], rtol=0, atol=1e-6)


def test_last_epoch_means_differ_with_train_mode_bn():
    """The same with BN in train mode (batch statistics): the two means are not the same numbers,
    which is why ``eval_pass`` is kept."""
    model = FrozenBN(frozen=False)
    means, _ = _train_pass_means(model, "features")
    exact, _ = local_class_averages(model, _loader(), K)
    assert max(float((means[c] - exact[c]).abs().max()) for c in exact) > 1e-2


@pytest.fixture(scope="module")
def federation():
    digits = load_dataset("digits", limit_per_class=12)
    y = digits.labels.numpy()
    idx = np.sort(np.concatenate([np.flatnonzero(y == c)[:6] for c in (1, 4, 7)]))
    split = ClientSplit(train=idx[3:], val=np.zeros(0, np.int64), test=idx[:3])
    part = Partition(clients=[split, split], public=np.zeros(0, np.int64), meta={})
    return digits, part


@pytest.mark.parametrize("name", ["fedproto", "fedtgp", "fd"])
def test_methods_upload_the_training_pass_means(name, federation):
    """``class_means: last_epoch``: the same classes (and FedProto's counts) as the exact pass,
    an upload the server's checks accept, and the same model trained."""
    digits, part = federation
    uploads, states = {}, {}
    for mode in ("eval_pass", "last_epoch"):
        algo = get_algorithm(name)(class_means=mode, local_epochs=2, **({"server_epochs": 1} if name == "fedtgp" else {}))
        fed, _ = build_group_federation(digits, part, ["cnn4-small", "cnn3-small"], algo, feature_dim=16, batch_size=4,
                                        seed=0)
        server_state, broadcast = algo.init_server(fed.server)
        torch.manual_seed(0)
        ctx = ClientContext(info=fed.clients[0], make_model=lambda arch=None: fed.client_model(0, arch),
                            train_loader=fed.loaders(0, "train", 1), val_loader=None,
                            test_loader=fed.loaders(0, "test", 1), n_classes=fed.n_classes, round=1)
        torch.manual_seed(1)
        states[mode], uploads[mode] = algo.client_update(algo.init_client(ctx), broadcast, ctx)
        algo.check_upload(uploads[mode], server_state, fed.clients[0], fed.n_classes)
    prefix = "logit." if name == "fd" else "proto."
    assert uploads["last_epoch"].tensors[prefix + "labels"].tolist() == [1, 4, 7]
    for key in uploads["eval_pass"].tensors:
        if not key.endswith("values"):  # labels, FedProto's counts
            assert torch.equal(uploads["last_epoch"].tensors[key], uploads["eval_pass"].tensors[key])
    for k, v in states["eval_pass"]["model"].items():  # collecting changes nothing of the training
        assert torch.equal(v, states["last_epoch"]["model"][k]), k
