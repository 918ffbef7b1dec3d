"""FedProto: federated prototype learning across heterogeneous clients.

Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022.

* Client ``i`` minimizes ``CE(h_i(f_i(x)), y) + lambda * ||f_i(x) - bar C^y||^2`` (Eq. 5; the
  official code and HtFLlib use ``MSELoss``, i.e. the squared distance over D, ``lambda = 1``),
  then computes its local prototypes ``C_i^j = 1/|D_i,j| sum f_i(x)`` (Eq. 4) for the classes it
  holds, uploading ``proto.values (S, D)``, ``proto.labels (S,)`` and ``proto.counts (S,)``. By
  default (``class_means: last_epoch``) the prototypes are the representations the last local
  epoch's training passes computed, collected inside the training loop as the official code and
  HtFLlib's ``clientProto.train`` do (they average every local epoch's passes, rafl the last
  epoch's, the passes of the weights closest to the trained ones): no extra pass over the data. ``class_means: eval_pass``
  takes Eq. 4 literally, with one more eval-mode pass after training: about 1.35x the client
  step, and 2.1 / 3.4 points more nearest-prototype accuracy on 2/2 seeds of the digits scenario
  (docs/algorithms.md).
* The server aggregates per class, weighted by the clients' per-class sample counts:
  ``bar C^j = sum_i |D_i,j| / N_j * C_i^j`` (Eq. 6), keeping the last prototype of classes no
  client of this round holds.
* Inference: the client's head (``model``) and the nearest global prototype (``proto``, Sec. 4.3).
  ``model`` is the deployed model that the run's headline numbers use (best round, CO to target,
  ``rafl compare``'s acc mean); the paper and HtFLlib's ``test_metrics`` report ``proto``, which
  is in every evaluated round's metrics and in compare's table beside it.

Where each step lives: local training with the prototype term (Eq. 5) and the local prototypes
(Eq. 4) :meth:`PrototypeFamily.client_update` (the term :meth:`FedProto.regularizer`); the upload's
check :meth:`FedProto.check_upload`; the per-class aggregation (Eq. 6)
:meth:`FedProto.server_aggregate` (:meth:`PrototypeFamily.merge`); evaluation of the head and the
nearest prototype :meth:`PrototypeFamily.prepare_evaluation` and :meth:`PrototypeFamily.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation.aggregation import bound_vectors
from rafl.federation.algorithms.base import DEPLOYED, Accuracy, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, bounded, choice
from rafl.federation.algorithms.prototype_family import PROTOTYPE, ClassMeans, ClassMeansHparams, PrototypeFamily
from rafl.federation.losses import prototype_regularizer
from rafl.federation.prototypes import check_class_upload, from_payload

PROTO = "proto."


#: the prototype distance of the client loss
Distance = choice("mse", "squared", "euclidean")


class FedProtoHparams(ClassMeansHparams):
    """FedProto's hyperparameters (Tan et al., AAAI 2022, Eq. 8)."""

    lambda_: Float = bounded(1.0, ge=0, alias="lambda")  # weight of the prototype term (official code: 1)
    distance: Distance = "mse"  # mse (official code) | squared | euclidean
    # prototypes from the last local epoch's training passes, as the official code and HtFLlib's
    # FedProto client collect them (no extra pass; bench/class_means.py: the step 0.72-0.74x)
    class_means: ClassMeans = "last_epoch"


@register
class FedProto(PrototypeFamily):
    """FedProto (Tan et al., AAAI 2022). Client state ``{"model": state_dict}``; server state
    ``{"values": (G, D), "labels": (G,)}`` (the global prototypes so far)."""

    name: ClassVar[str] = "fedproto"
    hparams_model: ClassVar[type[Hyperparameters]] = FedProtoHparams
    accuracies: ClassVar[tuple[Accuracy, ...]] = (DEPLOYED, PROTOTYPE)
    upload_prefix: ClassVar[str] = PROTO
    upload_counts: ClassVar[bool] = True

    def regularizer(self, targets):
        """``lambda * d(f(x), bar C^y)`` (Eq. 5), d the chosen ``distance``."""
        hp = self.hparams
        return prototype_regularizer(targets, float(hp["lambda"]), str(hp["distance"])), "lambda"

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        items = []
        bounded = bound_vectors([from_payload(u.tensors, PROTO) for u in uploads], server)  # engine.aggregation
        for u, protos in zip(uploads, bounded):
            counts = dict(zip(u.tensors[PROTO + "labels"].tolist(), u.tensors[PROTO + "counts"].tolist()))
            items.append((protos, counts))
        return self.merge(server_state, items)  # Eq. 6 for the classes held this round

    def check_upload(self, upload, server_state, client, n_classes):
        """Prototypes ``proto.values (S, D)`` (D that of the global prototypes once there are any),
        ``proto.labels (S,)`` distinct class ids < K, ``proto.counts (S,)`` positive
        (:func:`rafl.federation.prototypes.check_class_upload`)."""
        dim = int(server_state["values"].shape[1]) or None
        check_class_upload(upload.tensors, PROTO, n_classes=n_classes, dim=dim, counts=True)
        total = int(upload.tensors[PROTO + "counts"].to(torch.int64).sum())
        if total > client.n_samples:  # the Eq. 6 weights: no more samples than the client registered
            raise UserInputError(f"sums to {total} samples; allowed: at most the client's {client.n_samples} training "
                                 "samples", field=PROTO + "counts")
