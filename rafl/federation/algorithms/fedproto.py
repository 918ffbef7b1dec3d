"""FedProto: federated prototype learning across heterogeneous clients.

Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022.

* Client ``i`` minimizes ``CE(h_i(f_i(x)), y) + lambda * ||f_i(x) - bar C^y||^2`` (Eq. 5; the
  official code and HtFLlib use ``MSELoss``, i.e. the squared distance over D, ``lambda = 1``),
  then computes its local prototypes ``C_i^j = 1/|D_i,j| sum f_i(x)`` (Eq. 4) for the classes it
  holds, uploading ``proto.values (S, D)``, ``proto.labels (S,)`` and ``proto.counts (S,)``.
* The server aggregates per class, weighted by the clients' per-class sample counts:
  ``bar C^j = sum_i |D_i,j| / N_j * C_i^j`` (Eq. 6), keeping the last prototype of classes no
  client of this round holds.
* Inference: the client's head (``model``) and the nearest global prototype (``proto``, Sec. 4.3).
  ``model`` is the deployed model that the run's headline numbers use (best round, CO to target,
  ``rafl compare``'s acc mean); the paper and HtFLlib's ``test_metrics`` report ``proto``, which
  is in every evaluated round's metrics and in compare's table beside it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation.aggregation import bound_vectors
from rafl.federation.algorithms._common import (build, cpu_state, divergence_keys, eval_counts,
                                               optimizer_for)
from rafl.federation.algorithms.base import Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, LocalTraining, bounded, choice
from rafl.federation.headers import feature_dim
from rafl.federation.losses import prototype_regularizer, train_regularized
from rafl.federation.payload import Payload
from rafl.federation.prototypes import (check_class_upload, evaluate_head_and_prototypes, from_payload, local_class_averages,
                                        to_payload_tensors, weighted_class_average)

PROTO = "proto."
GLOBAL = "global."


#: the prototype distance of the client loss
Distance = choice("mse", "squared", "euclidean")


class FedProtoHparams(LocalTraining):
    """FedProto's hyperparameters (Tan et al., AAAI 2022, Eq. 8)."""

    lambda_: Float = bounded(1.0, ge=0, alias="lambda")  # weight of the prototype term (official code: 1)
    distance: Distance = "mse"  # mse (official code) | squared | euclidean


@register
class FedProto(Algorithm):
    """FedProto (Tan et al., AAAI 2022). Client state ``{"model": state_dict}``; server state
    ``{"values": (G, D), "labels": (G,)}`` (the global prototypes so far)."""

    name: ClassVar[str] = "fedproto"
    hparams_model: ClassVar[type[Hyperparameters]] = FedProtoHparams

    def init_server(self, server: ServerContext):
        # (0, D): the prototype width D every upload must have, from round 1 on (D of client 0's model)
        width = feature_dim(server.make_model(client_id=server.clients[0].client_id)) if server.clients else 0
        return {"values": torch.zeros(0, width), "labels": torch.zeros(0, dtype=torch.int32)}, Payload()

    def init_client(self, client: ClientContext):
        return {"model": cpu_state(client.make_model())}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        model = build(client, state["model"])
        protos = from_payload(broadcast.tensors, GLOBAL) if broadcast.tensors else {}
        reg = prototype_regularizer(protos, float(hp["lambda"]), str(hp["distance"]))
        train_regularized(model, client.train_loader, optimizer_for(model, hp), reg, epochs=hp["local_epochs"],
                          device=client.device, diverged=divergence_keys(hp, self.defaults, "lambda"))
        local, counts = local_class_averages(model, client.train_loader, client.n_classes, device=client.device)
        tensors = to_payload_tensors(local, PROTO)
        tensors[PROTO + "counts"] = torch.tensor([counts[c] for c in sorted(local)], dtype=torch.int32)
        return {"model": cpu_state(model)}, Payload(tensors)

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        items = []
        bounded = bound_vectors([from_payload(u.tensors, PROTO) for u in uploads], server)  # engine.aggregation
        for u, protos in zip(uploads, bounded):
            counts = dict(zip(u.tensors[PROTO + "labels"].tolist(), u.tensors[PROTO + "counts"].tolist()))
            items.append((protos, counts))
        merged = from_payload({GLOBAL + "values": server_state["values"], GLOBAL + "labels": server_state["labels"]},
                              GLOBAL) if len(server_state["labels"]) else {}
        merged.update(weighted_class_average(items))  # Eq. 6 for the classes held this round
        tensors = to_payload_tensors(merged, GLOBAL)
        state = {"values": tensors[GLOBAL + "values"], "labels": tensors[GLOBAL + "labels"]}
        return state, Payload(tensors) if merged else Payload()

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

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {**state, "global": dict(broadcast.tensors)}

    def evaluate(self, state, client: ClientContext):
        model = build(client, state["model"])
        glob = state.get("global") or {}
        protos = from_payload(glob, GLOBAL) if glob else {}
        head, proto = evaluate_head_and_prototypes(model, client.test_loader, protos, device=client.device)
        return {**eval_counts("model", *head), **eval_counts("proto", *proto)}
