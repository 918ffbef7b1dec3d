"""FD (Federated Distillation, "FedDistill"): clients share per-class average logits.

Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data", NeurIPS-W 2018 (Sec. 2). Model-agnostic: nothing but
K-dimensional logit vectors travels, so any architectures can federate.

* Client ``i`` trains with ``CE(z(x), y) + gamma * MSE(z(x), bar z^y)`` against the global
  average logit vector of the sample's class (round 1: CE only), then uploads its per-class mean
  logits ``z_i^c`` (running per-class sum over its training set, eval mode) for the classes it
  holds: ``logit.values (S, K)`` + ``logit.labels (S,)``.
* The server averages them per class over the uploading clients (equal weights, as in the paper
  and HtFLlib's ``serverdistill``), keeping earlier averages of classes absent this round.

Two deliberate deviations from the paper, both as HtFLlib implements FD: the regularizer is the
MSE to the target logits (the paper distils with a cross-entropy on them), and every client gets the
one per-class average, its own logits included (the paper's Algorithm 1 gives device ``i`` the
average of the *other* devices' logits, ``(sum_j z_j^c - z_i^c) / (M - 1)``; the two targets differ
by the client's own share, ``1/M`` of the average).
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.aggregation import bound_vectors
from rafl.federation.algorithms._common import build, cpu_state, divergence_keys, eval_counts, optimizer_for
from rafl.federation.algorithms.base import Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, LocalTraining, bounded
from rafl.federation.algorithms.fedproto import FedProto
from rafl.federation.losses import logit_regularizer, train_regularized
from rafl.federation.payload import Payload
from rafl.federation.prototypes import (check_class_upload, from_payload, local_class_averages, to_payload_tensors,
                                        weighted_class_average)
from rafl.federation.training import evaluate_accuracy

LOGIT = "logit."
GLOBAL = "global."


class FDHparams(LocalTraining):
    """FD's hyperparameters (Jeong et al., 2018)."""

    gamma: Float = bounded(1.0, ge=0)  # weight of the distillation term


@register
class FD(Algorithm):
    """FD / FedDistill. Client state ``{"model": state_dict}``; server ``{"values", "labels"}``."""

    name: ClassVar[str] = "fd"
    hparams_model: ClassVar[type[Hyperparameters]] = FDHparams

    # the same start as FedProto: no global per-class vectors yet, each client's own model
    init_server = FedProto.init_server
    init_client = FedProto.init_client

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        model = build(client, state["model"])
        targets = from_payload(broadcast.tensors, GLOBAL) if broadcast.tensors else {}
        train_regularized(model, client.train_loader, optimizer_for(model, hp),
                          logit_regularizer(targets, float(hp["gamma"])), epochs=hp["local_epochs"],
                          device=client.device, diverged=divergence_keys(hp, self.defaults, "gamma"))
        logits, _ = local_class_averages(model, client.train_loader, client.n_classes, output="logits",
                                         device=client.device)
        return {"model": cpu_state(model)}, Payload(to_payload_tensors(logits, LOGIT))

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        merged = (from_payload({GLOBAL + "values": server_state["values"], GLOBAL + "labels": server_state["labels"]},
                               GLOBAL) if len(server_state["labels"]) else {})
        bounded = bound_vectors([from_payload(u.tensors, LOGIT) for u in uploads], server)  # engine.aggregation
        merged.update(weighted_class_average((p, None) for p in bounded))
        tensors = to_payload_tensors(merged, GLOBAL)
        return ({"values": tensors[GLOBAL + "values"], "labels": tensors[GLOBAL + "labels"]},
                Payload(tensors) if merged else Payload())

    def check_upload(self, upload, server_state, client, n_classes):
        """Mean logits: ``logit.values (S, K)``, ``logit.labels (S,)`` distinct class ids < K
        (:func:`rafl.federation.prototypes.check_class_upload`)."""
        check_class_upload(upload.tensors, LOGIT, n_classes=n_classes, dim=n_classes)

    def evaluate(self, state, client: ClientContext):
        return eval_counts("model", *evaluate_accuracy(build(client, state["model"]), client.test_loader,
                                                       device=client.device))
