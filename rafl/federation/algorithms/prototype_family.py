"""The prototype family: FedProto, FedTGP and FD, written once where the three agree.

* Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022;
* Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive
  Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024;
* Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
  Augmentation under Non-IID Private Data", NeurIPS-W 2018 (FD).

A client keeps only its own model (state ``{"model": state_dict}``, any architecture). Each round
it trains ``CE(h(f(x)), y) + reg(f(x), z(x), y)``, a pull toward the broadcast's global per-class
vectors ``global.values (G, r)`` + ``global.labels (G,)`` (none in round 1: plain CE), then uploads
its own per-class means of the same kind of vector -- the representation ``f(x)`` (prototypes,
FedProto Eq. 4) or the logits ``z(x)`` (FD) -- for the classes it holds, as ``<prefix>values (S,
r)`` + ``<prefix>labels (S,)`` (:func:`rafl.federation.prototypes.to_payload_tensors`). A method
supplies its regularizer (:meth:`PrototypeFamily.regularizer`), its wire prefix and its server.

Where the per-class means come from (``class_means``, :class:`ClassMeansHparams`):

* ``eval_pass`` (FedTGP's default): one more no-grad pass over the client's training data after local training, in
  eval mode (BN running statistics): Eq. 4 of FedProto taken literally, ``C_i^j = 1/|D_i,j| sum
  f_i(x)`` with the trained model ``f_i``, and what HtFLlib's FedTGP client computes
  (``collect_protos``);
* ``last_epoch`` (FedProto's and FD's default): the forward passes of the last local epoch, which training runs anyway (train
  mode: BN normalizes with each batch's statistics; the weights move between batches): what the
  official FedProto code and HtFLlib's FedProto and FD clients upload, and one pass over the data
  fewer. With BN frozen and the weights unchanged (learning rate 0) the two are the same numbers.

Where each step lives: local training and the upload :meth:`PrototypeFamily.client_update`
(:func:`rafl.federation.training.train_regularized`; the per-class means
:func:`rafl.federation.prototypes.local_class_averages`, or with ``last_epoch``
:class:`rafl.federation.prototypes.RunningClassMeans`); the per-class merge of FedProto and FD
:meth:`PrototypeFamily.merge`; the global vectors kept for evaluation
:meth:`PrototypeFamily.prepare_evaluation`; evaluation :meth:`PrototypeFamily.evaluate`; each
method's regularizer, server step and upload check in its own module.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from rafl.federation.algorithms._common import build, cpu_state, divergence_keys, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Accuracy, Algorithm, ClientContext, ServerContext
from rafl.federation.algorithms.hparams import LocalTraining, choice
from rafl.federation.headers import feature_dim
from rafl.federation.losses import Regularizer
from rafl.federation.payload import Payload
from rafl.federation.prototypes import (
    RunningClassMeans,
    evaluate_head_and_prototypes,
    from_payload,
    local_class_averages,
    to_payload_tensors,
    weighted_class_average,
)
from rafl.federation.training import evaluate_accuracy, train_regularized

#: the wire prefix of the server's broadcast of global per-class vectors
GLOBAL = "global."
#: nearest-prototype inference (FedProto Sec. 4.3; FedTGP): the class of the nearest global prototype
PROTOTYPE = Accuracy("proto", "nearest prototype", "nearest-prototype accuracy")

#: where the uploaded per-class means come from (the module docstring)
ClassMeans = choice("eval_pass", "last_epoch")


class ClassMeansHparams(LocalTraining):
    """Local training plus ``class_means``: ``eval_pass`` (one more pass, eval mode) or
    ``last_epoch`` (the last local epoch's training passes)."""

    class_means: ClassMeans = "eval_pass"


class PrototypeFamily(Algorithm):
    """The client side of FedProto, FedTGP and FD, and the per-class merge of FedProto and FD.

    Class attributes:
        upload_prefix: the upload's wire prefix (``"proto."``, ``"logit."``).
        vectors: ``"features"`` (prototypes of ``f(x)``, (S, D)) or ``"logits"`` (FD, (S, K)).
        upload_counts: whether the upload carries ``<prefix>counts (S,)`` int32, the per-class
            training-sample counts (FedProto's Eq. 6 weights).

    Evaluated: the client's head (``model``) and, when :data:`PROTOTYPE` is among
    :attr:`accuracies`, the nearest global prototype (``proto``).
    """

    upload_prefix: ClassVar[str] = "proto."
    vectors: ClassVar[str] = "features"
    upload_counts: ClassVar[bool] = False

    @abstractmethod
    def regularizer(self, targets: dict[int, torch.Tensor]) -> tuple[Regularizer, str]:
        """The client's term toward the global vectors ``targets`` (``{class id: (r,)}``, empty in
        round 1) and the hyperparameter that weighs it (what a diverged loss names)."""

    def init_server(self, server: ServerContext):
        """No global vectors yet: ``{"values": (0, r), "labels": (0,)}`` with r the width every
        upload must have (D of client 0's model for prototypes, K for logits)."""
        width = 0
        if server.clients:
            width = (server.n_classes if self.vectors == "logits"
                     else feature_dim(server.make_model(client_id=server.clients[0].client_id)))
        return {"values": torch.zeros(0, width), "labels": torch.zeros(0, dtype=torch.int32)}, Payload()

    def init_client(self, client: ClientContext):
        return {"model": cpu_state(client.make_model())}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        model = build(client, state["model"])
        targets = from_payload(broadcast.tensors, GLOBAL) if broadcast.tensors else {}
        reg, weight = self.regularizer(targets)
        seen = RunningClassMeans(client.n_classes) if hp["class_means"] == "last_epoch" else None
        train_regularized(model, client.train_loader, optimizer_for(model, hp), reg, epochs=hp["local_epochs"],
                          device=client.device, diverged=divergence_keys(hp, self.defaults, weight),
                          last_epoch=None if seen is None else self._collector(seen))
        if seen is not None:
            means, counts = seen.result()
        else:
            means, counts = local_class_averages(model, client.train_loader, client.n_classes, output=self.vectors,
                                                 device=client.device)
        tensors = to_payload_tensors(means, self.upload_prefix)
        if self.upload_counts:
            tensors[self.upload_prefix + "counts"] = torch.tensor([counts[c] for c in sorted(means)],
                                                                  dtype=torch.int32)
        return {"model": cpu_state(model)}, Payload(tensors)

    def _collector(self, seen: RunningClassMeans):
        logits = self.vectors == "logits"

        def collect(features: torch.Tensor, out: torch.Tensor, labels: torch.Tensor) -> None:
            seen.add(out if logits else features, labels)

        return collect

    def merge(self, server_state, per_class: list[tuple[dict[int, torch.Tensor], dict[int, int] | None]]):
        """The new server state and broadcast: the weighted per-class average of this round's
        uploads (:func:`~rafl.federation.prototypes.weighted_class_average`; ``None`` counts =
        equal weights) over the classes held this round, the last vectors of the others kept."""
        merged = from_payload({GLOBAL + "values": server_state["values"], GLOBAL + "labels": server_state["labels"]},
                              GLOBAL) if len(server_state["labels"]) else {}
        merged.update(weighted_class_average(per_class))
        tensors = to_payload_tensors(merged, GLOBAL)
        state = {"values": tensors[GLOBAL + "values"], "labels": tensors[GLOBAL + "labels"]}
        return state, Payload(tensors) if merged else Payload()

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        if PROTOTYPE not in self.accuracies:
            return state
        return {**state, "global": dict(broadcast.tensors)}

    def evaluate(self, state, client: ClientContext):
        model = build(client, state["model"])
        if PROTOTYPE not in self.accuracies:
            return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(model, client.test_loader, device=client.device))
        glob = state.get("global") or {}
        protos = from_payload(glob, GLOBAL) if glob else {}
        head, proto = evaluate_head_and_prototypes(model, client.test_loader, protos, device=client.device)
        return {**eval_counts(DEPLOYED.prefix, *head), **eval_counts(PROTOTYPE.prefix, *proto)}


__all__ = ["ClassMeans", "ClassMeansHparams", "GLOBAL", "PROTOTYPE", "PrototypeFamily"]
