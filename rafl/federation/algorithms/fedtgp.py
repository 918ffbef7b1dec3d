"""FedTGP: trainable global prototypes with adaptive-margin-enhanced contrastive learning.

Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive
Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024.

Client ``i`` (any architecture; representation ``f_i(x)`` of width D):

* loss ``CE(h_i(f_i(x)), y) + lambda * phi(f_i(x), hat P^y)`` with the global prototype ``hat P^y``
  of the sample's class and ``phi`` the Euclidean distance, ``lambda = 0.1`` (the paper). The
  squared-distance variant is ``distance: mse`` (PyTorch ``MSELoss`` as in HtFLlib's client) with
  its own weight ``lambda_mse``. Round 1 (no global prototypes yet) is plain CE.
* after training: local prototypes ``P_i^c`` = per-class averaged representations of the classes
  it holds (running per-class sum), uploaded as ``proto.values (S, D)`` + ``proto.labels (S,)``.

Server: one learnable vector per class ``e_c`` passed through a shared two-layer network ``F``
(``Linear(D, H) -> ReLU -> Linear(H, D)``), ``hat P^c = F(e_c)``. Each round:

1. ``Q^c`` = average of the uploaded ``P_i^c`` (equal weights); the adaptive margin
   ``delta(t) = min(max_c min_{c' != c} ||Q^c - Q^c'||_2, tau)``, ``tau = 100``
   (:func:`rafl.federation.prototypes.adaptive_margin`);
2. ``server_epochs`` (S, default 100) epochs of SGD over mini-batches of the uploaded ``P_i^c`` on
   the margin-enhanced contrastive loss ``CE(-(phi(P_i^c, hat P^k) + delta * [k = c])_k, c)``:
   the prototype of the right class must be nearer than every other by at least ``delta``;
3. broadcast ``hat P^c`` of every class uploaded so far.

Reported per client: ``model`` (the client's head) and ``proto`` (nearest global prototype).

Where each step lives: local training with the prototype term and the local prototypes
:meth:`PrototypeFamily.client_update` (the term :meth:`FedTGP.regularizer`); the upload's check
:meth:`FedTGP.check_upload`; the adaptive margin and the server's training of the trainable
prototypes (steps 1-2) :meth:`FedTGP.server_aggregate` (:class:`TrainablePrototypes`,
:func:`margin_contrastive_loss`), their broadcast (step 3) :meth:`FedTGP._broadcast`; evaluation
:meth:`PrototypeFamily.prepare_evaluation` and :meth:`PrototypeFamily.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rafl.errors import warn
from rafl.federation.aggregation import bound_vectors
from rafl.federation.algorithms._common import cpu_state
from rafl.federation.algorithms.base import DEPLOYED, Accuracy, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, Int, bounded, choice, width
from rafl.federation.algorithms.prototype_family import GLOBAL, PROTOTYPE, ClassMeansHparams, PrototypeFamily
from rafl.federation.headers import check_split_model, feature_dim
from rafl.federation.losses import prototype_regularizer
from rafl.federation.payload import Payload
from rafl.federation.prototypes import (
    adaptive_margin,
    check_class_upload,
    from_payload,
    pairwise_distances,
    to_payload_tensors,
    weighted_class_average,
)
from rafl.federation.training import train_sgd

PROTO = "proto."


class TrainablePrototypes(nn.Module):
    """FedTGP's server model: ``hat P = F(E)``, ``E`` (K, D) learnable, ``F`` two layers.

    Args:
        n_classes: K.
        dim: D, the clients' representation width.
        hidden: H, the hidden width of F.

    ``forward(classes (M,) int64) -> (M, D)`` global prototypes.
    """

    def __init__(self, n_classes: int, dim: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(n_classes, dim)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, classes: torch.Tensor) -> torch.Tensor:
        return self.net(self.embedding(classes))


def margin_contrastive_loss(client_protos: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor,
                            margin: float) -> torch.Tensor:
    """FedTGP's adaptive-margin-enhanced contrastive loss (server side), batch mean.

    ``-log( exp(-(phi(P, hat P^y) + delta)) / (exp(-(phi(P, hat P^y) + delta)) + sum_{k != y}
    exp(-phi(P, hat P^k))) )`` = ``CE(-(D + delta * onehot(y)), y)``.

    Args:
        client_protos: (B, D) uploaded client prototypes (constants).
        labels: (B,) int64 their classes.
        global_protos: (K, D) the current trainable global prototypes.
        margin: delta >= 0.

    Returns:
        scalar loss (NaN-free also when a prototype coincides with a global one).
    """
    dist = pairwise_distances(client_protos, global_protos)
    dist = dist + float(margin) * F.one_hot(labels, global_protos.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


#: the prototype distance of the client loss
Distance = choice("euclidean", "mse")


class FedTGPHparams(ClassMeansHparams):
    """FedTGP's hyperparameters (Zhang et al., AAAI 2024): the client's prototype distance (Eq. 4)
    and the server's trainable prototypes with their adaptive margin (Eqs. 5-7)."""

    lambda_: Float = bounded(0.1, ge=0, alias="lambda")  # weight of the Euclidean prototype distance (the paper)
    distance: Distance = "euclidean"   # euclidean (paper) | mse (squared-distance variant)
    lambda_mse: Float = bounded(1.0, ge=0)               # weight of the mse variant (HtFLlib's lamda for MSELoss)
    tau: Float = bounded(100.0, gt=0)                    # margin threshold
    server_epochs: Int = bounded(100, ge=1)              # S
    server_lr: Float = bounded(0.01, gt=0)
    server_batch_size: Int = bounded(32, ge=1)
    server_hidden_dim: Int = width(0)                    # H of the prototype network; 0 = D


@register
class FedTGP(PrototypeFamily):
    """FedTGP (Zhang et al., AAAI 2024). Client state ``{"model": state_dict}``; server state
    ``{"net": TrainablePrototypes state_dict, "seen": [class ids], "margin": float, "server_loss":
    float}`` (the margin and the mean contrastive loss of the last server epoch of the round)."""

    name: ClassVar[str] = "fedtgp"
    hparams_model: ClassVar[type[Hyperparameters]] = FedTGPHparams
    accuracies: ClassVar[tuple[Accuracy, ...]] = (DEPLOYED, PROTOTYPE)
    upload_prefix: ClassVar[str] = PROTO

    @classmethod
    def check_hparams(cls, hparams):
        """:class:`FedTGPHparams` checked; warns when a weight is set to a non-default value that the
        chosen distance does not use (``lambda_mse`` with ``euclidean``, ``lambda`` with ``mse``;
        ``hparams`` may be a resolved config holding every default, which is no reason to warn)."""
        hp = super().check_hparams(hparams)
        unused = "lambda_mse" if hp["distance"] == "euclidean" else "lambda"
        if unused in hparams and hparams[unused] != cls.defaults[unused]:
            # named without a section: algorithm.X in rafl federate, algorithm.fedtgp.X in rafl compare
            warn(f"fedtgp: {unused} has no effect with distance: {hp['distance']} (its weight is "
                 f"{'lambda' if unused == 'lambda_mse' else 'lambda_mse'})")
        return hp

    def _net(self, n_classes: int, dim: int) -> TrainablePrototypes:
        hidden = int(self.hparams["server_hidden_dim"]) or dim
        return TrainablePrototypes(n_classes, dim, hidden)

    def init_server(self, server: ServerContext):
        model = server.make_model(client_id=server.clients[0].client_id)
        check_split_model(model, "client 0 model")
        net = self._net(server.n_classes, feature_dim(model))
        return {"net": cpu_state(net), "seen": [], "margin": 0.0}, Payload()

    def regularizer(self, targets):
        """``lambda * ||f(x) - hat P^y||_2`` (the paper), or ``lambda_mse * MSE`` with ``distance: mse``."""
        hp = self.hparams
        weight = "lambda" if hp["distance"] == "euclidean" else "lambda_mse"
        return prototype_regularizer(targets, float(hp[weight]), str(hp["distance"])), weight

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        hp = self.hparams
        per_client = bound_vectors([from_payload(u.tensors, PROTO) for u in uploads], server)  # engine.aggregation
        seen = sorted(set(server_state["seen"]) | {c for p in per_client for c in p})
        net_state = server_state["net"]
        dim = net_state["embedding.weight"].shape[1]
        net = self._net(server.n_classes, dim)
        net.load_state_dict(net_state)
        net.to(server.device).train()
        margin = server_state.get("margin", 0.0)
        last_loss = server_state.get("server_loss", 0.0)
        pairs = [(v, c) for p in per_client for c, v in p.items()]
        if pairs:
            margin = adaptive_margin(weighted_class_average((p, None) for p in per_client), float(hp["tau"]))
            x = torch.stack([v for v, _ in pairs]).to(server.device)
            y = torch.tensor([c for _, c in pairs], dtype=torch.long, device=server.device)
            all_classes = torch.arange(server.n_classes, device=server.device)
            gen = torch.Generator().manual_seed(int(server.seed))  # the round's server seed
            bs = int(hp["server_batch_size"])

            def batches():  # a fresh shuffle of the uploaded prototypes every epoch
                order = torch.randperm(len(y), generator=gen)
                return (order[i:i + bs].to(server.device) for i in range(0, len(y), bs))

            def loss_of(idx):  # Eq. 5 on a mini-batch of uploaded prototypes
                return margin_contrastive_loss(x[idx], y[idx], net(all_classes), margin)

            history = train_sgd(net, batches, loss_of, epochs=hp["server_epochs"], lr=hp["server_lr"],
                                what="server training of the global prototypes", field="algorithm.server_lr")
            if history:
                last_loss = sum(history[-1]) / max(1, len(history[-1]))
        new_state = {"net": cpu_state(net), "seen": seen, "margin": float(margin), "server_loss": float(last_loss)}
        return new_state, self._broadcast(net, seen, server.device)

    def check_upload(self, upload, server_state, client, n_classes):
        """Prototypes: ``proto.values (S, D)`` with D the server network's width, ``proto.labels
        (S,)`` distinct class ids < K (:func:`rafl.federation.prototypes.check_class_upload`)."""
        check_class_upload(upload.tensors, PROTO, n_classes=n_classes,
                           dim=int(server_state["net"]["embedding.weight"].shape[1]))

    @staticmethod
    def _broadcast(net: TrainablePrototypes, seen: list[int], device) -> Payload:
        if not seen:
            return Payload()
        with torch.no_grad():
            protos = net(torch.tensor(seen, dtype=torch.long, device=device)).cpu()
        return Payload(to_payload_tensors({c: protos[i] for i, c in enumerate(seen)}, GLOBAL))
