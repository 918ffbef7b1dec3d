"""RaFL: resource-aware FL with specialized local models and averaged knowledge networks.

Yu et al., "Resource-aware Federated Learning using Knowledge Extraction and Multi-model Fusion".
Every client ``l`` keeps its own resource-aware subnet ``theta_l`` (found by the search for its
device profile) and, each round, downloads the global *knowledge network* ``theta_k`` -- a small
subnet of the same supernet: by default the search space's smallest subnet with its hidden and head
channels narrowed to ``knowledge_width = 0.375`` (:func:`rafl.supernet.model.narrow_width`, OFA's
elastic width by channel sorting). The narrowing matters for communication: the MobileNet-V3 head
(final-expand + feature-mix layers) is shared by every subnet and holds over half of the smallest
subnet's parameters, so without it the knowledge network could not be much smaller than the
specialized models (quickstart supernet: 280 k parameters for the smallest subnet, 70 k narrowed;
``knowledge_width: 1`` gives the plain smallest subnet). The default 0.375 was the best of 0.25 /
0.375 / 0.5 in ``bench/federate_rafl.py``'s CIFAR-10 scenario (accuracy gain vs upload). Locally the two learn from
each other by deep mutual learning (Eqs. 3-6, :func:`rafl.federation.training.train_mutual`):

    L(theta_l) = CE(p_l, y) + KL(p_k || p_l)          (Eqs. 3-4)
    L(theta_k) = CE(p_k, y) + KL(p_l || p_k)          (Eqs. 5-6)

and both optimizers step. Only ``theta_k`` is uploaded; the server averages the received
knowledge networks weighted by ``n_l / N_S`` (Eq. 7). Optionally (``distill: true``) the server
then distils the ensemble of the received knowledge networks into the average on its unlabeled
public pool ``D_p``: the teacher is the mean of their logits (Eq. 8) and the student minimizes
``KL(softmax(mean logits / T) || softmax(theta_k(x) / T))`` (Eq. 9).

Reported per client: ``model`` = the specialized subnet (what the device deploys) and
``knowledge`` = the latest global knowledge network, both on the client's own test split.

State: client ``{"local": state_dict of theta_l}``; server ``{"knowledge": state_dict}``.
Payload tensor names: ``"knowledge.<state_dict key>"``; upload meta ``n_samples``.

Where each step lives: the knowledge network :meth:`RaFL._knowledge`
(:func:`resolve_knowledge_arch`, :func:`rafl.supernet.model.narrow_width`); deep mutual learning
(Eqs. 3-6) and the upload :meth:`RaFL.client_update`
(:func:`rafl.federation.training.train_mutual`); the average (Eq. 7) :meth:`RaFL.server_aggregate`,
the optional distillation (Eqs. 8-9) :meth:`RaFL._distill`; evaluation
:meth:`RaFL.prepare_evaluation` and :meth:`RaFL.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation.aggregation import server_average
from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import (
    DEPLOYED,
    Accuracy,
    Algorithm,
    ClientContext,
    ClientInfo,
    ServerContext,
    register,
)
from rafl.federation.algorithms.hparams import Bool, Float, Hyperparameters, Int, LocalTraining, Text, bounded, fraction
from rafl.federation.payload import Payload
from rafl.federation.training import distill_kl, evaluate_accuracy, make_optimizer, predict_logits, train_mutual
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.supernet.model import Subnet, narrow_width

PREFIX = "knowledge."


def resolve_knowledge_arch(spec: str, space: SearchSpace | None) -> ArchConfig | None:
    """The knowledge network's arch from its spec: ``"smallest"``, ``"middle"``, ``"largest"`` or
    an arch string (``ArchConfig.to_string``). Returns None when there is no search space (models
    built by a custom factory, which then receives ``"knowledge"``).

    Raises:
        UserInputError: an unknown spec / malformed arch string (field ``algorithm.knowledge_arch``).
    """
    if space is None:
        if spec != "smallest":  # the default; anything else would be silently ignored
            raise UserInputError(f"is {spec!r}, but model-group clients have no supernet to cut it from: the "
                                 "shared model is the group's knowledge model; allowed here: smallest (the "
                                 "default), or use clients.models: nas (rafl compare: --models nas)",
                                 field="algorithm.knowledge_arch")
        return None
    named = {"smallest": space.smallest, "middle": space.middle, "largest": space.largest}
    if spec in named:
        return named[spec]()
    try:
        return ArchConfig.from_string(spec, space)
    except UserInputError as err:
        raise UserInputError(f"{err.message}; or one of smallest, middle, largest",
                             field="algorithm.knowledge_arch") from None


class RaFLHparams(LocalTraining):
    """RaFL's hyperparameters (Yu et al., 2022): the knowledge network, DML (Eqs. 4-6) and the
    optional server ensemble distillation (Eqs. 8-9)."""

    knowledge_arch: Text = "smallest"
    knowledge_width: Float = fraction(0.375)  # share of hidden/head channels kept (narrow_width)
    temperature: Float = bounded(1.0, gt=0)   # DML softmax temperature (Eqs. 4, 6)
    alpha: Float = bounded(1.0, ge=0)         # weight of the KL terms
    distill: Bool = False                     # server ensemble distillation on the public pool (Eqs. 8-9)
    distill_epochs: Int = bounded(1, ge=1)
    distill_lr: Float = bounded(0.01, gt=0)
    distill_temperature: Float = bounded(1.0, gt=0)
    distill_batch_size: Int = bounded(64, ge=1)


@register
class RaFL(Algorithm):
    """RaFL (Yu et al.): deep mutual learning with a shared, averaged knowledge network."""

    name: ClassVar[str] = "rafl"
    accuracies: ClassVar[tuple[Accuracy, ...]] = (DEPLOYED, Accuracy("knowledge", "knowledge network",
                                                                "knowledge network accuracy"))
    hparams_model: ClassVar[type[Hyperparameters]] = RaFLHparams
    uses_public_pool: ClassVar[bool] = False

    def _knowledge(self, make_model, space):
        arch = resolve_knowledge_arch(str(self.hparams["knowledge_arch"]), space)
        if arch is None:  # a custom model factory builds its own knowledge network
            return make_model("knowledge")
        model = make_model(arch)
        width = float(self.hparams["knowledge_width"])
        return narrow_width(model, width) if isinstance(model, Subnet) and width < 1 else model

    def init_server(self, server: ServerContext):
        if self.hparams["distill"] and (server.public_images is None or len(server.public_images) == 0):
            raise UserInputError("is true but the run has no public pool (set partition.public_fraction > 0)",
                                 field="algorithm.distill")
        knowledge = cpu_state(self._knowledge(server.make_model, server.space))
        return {"knowledge": knowledge}, Payload.from_state_dict(knowledge, PREFIX)

    def init_client(self, client: ClientContext):
        return {"local": cpu_state(client.make_model())}

    def _build_knowledge(self, client: ClientContext, weights):
        model = self._knowledge(client.make_model, client.space)
        model.load_state_dict(weights, strict=True)
        return model.to(client.device).train()

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        local = build(client, state["local"])
        know = self._build_knowledge(client, broadcast.state_dict(PREFIX))
        alpha = float(hp["alpha"])
        train_mutual(local, know, client.train_loader, optimizer_for(local, hp), optimizer_for(know, hp),
                     epochs=hp["local_epochs"], ce_a=1.0, kl_a=alpha, ce_b=1.0, kl_b=alpha,
                     temperature=float(hp["temperature"]), device=client.device)
        upload = Payload.from_state_dict(cpu_state(know), PREFIX, meta={"n_samples": client.n_samples})
        return {"local": cpu_state(local)}, upload

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        if not uploads:
            return server_state, Payload.from_state_dict(server_state["knowledge"], PREFIX)
        states = [u.state_dict(PREFIX) for u in uploads]
        merged = server_average(states, uploads, server, reference=server_state["knowledge"])  # Eq. 7
        if self.hparams["distill"]:
            merged = self._distill(merged, states, server)
        return {"knowledge": merged}, Payload.from_state_dict(merged, PREFIX)

    def _distill(self, merged, states, server: ServerContext):
        """Eqs. 8-9 on the public pool: ensemble-mean logits of the received knowledge nets as soft
        targets for the averaged knowledge net."""
        hp = self.hparams
        images = server.public_images
        logits = []
        for sd in states:
            teacher = self._knowledge(server.make_model, server.space)
            teacher.load_state_dict(sd)
            logits.append(predict_logits(teacher.to(server.device), images, device=server.device))
        targets = torch.stack(logits).mean(0)  # Eq. 8
        student = self._knowledge(server.make_model, server.space)
        student.load_state_dict(merged)
        student.to(server.device)
        opt = make_optimizer(student, "adam", lr=float(hp["distill_lr"]))
        gen = torch.Generator().manual_seed(int(server.seed))  # the round's server seed
        distill_kl(student, images, targets, opt, temperature=float(hp["distill_temperature"]),
                   epochs=int(hp["distill_epochs"]), batch_size=int(hp["distill_batch_size"]),
                   generator=gen, device=server.device)  # Eq. 9
        return cpu_state(student)

    def upload_spec(self, server_state, client: ClientInfo):
        return {PREFIX + k: tuple(v.shape) for k, v in server_state["knowledge"].items()}

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {**state, "knowledge": broadcast.state_dict(PREFIX)}

    def evaluate(self, state, client: ClientContext):
        out = eval_counts(DEPLOYED.prefix, *evaluate_accuracy(build(client, state["local"]), client.test_loader,
                                                      device=client.device))
        if "knowledge" in state:
            know = self._build_knowledge(client, state["knowledge"])
            out.update(eval_counts("knowledge", *evaluate_accuracy(know, client.test_loader, device=client.device)))
        return out
