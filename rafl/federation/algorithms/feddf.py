"""FedDF: ensemble distillation for robust model fusion (Lin et al., NeurIPS 2020).

Clients may hold different architectures. Clients are grouped by architecture (``model_key``);
each group has a global model. Per round (Alg. 1 of the paper): every sampled client trains its
group's model with cross-entropy and uploads it; the server averages the uploads within each
group (FedAvg, weights ``n_l / n``), then distils the ensemble of *all* received models into every
group's average on the unlabeled public pool: teacher = mean of the received models' logits
(Eq. 2's ``(1/|S|) sum f(x; w_l)``), loss = ``KL(softmax(teacher/T) || softmax(student/T))``.
Each client downloads only its group's model (tensor names ``"<group>/<key>"``, ``<group>`` a
stable hash of the architecture). Evaluation uses the client's group model.

Where each step lives: a client's group model :meth:`FedDF.client_broadcast`; local training
:meth:`FedDF.client_update`; the group averages and the ensemble distillation
:meth:`FedDF.server_aggregate` (:func:`rafl.federation.training.distill_kl`); evaluation
:meth:`FedDF.prepare_evaluation` and :meth:`FedDF.evaluate`.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation.aggregation import clipped_states, payload_weights, robust_average
from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Algorithm, ClientContext, ClientInfo, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, Int, LocalTraining, bounded
from rafl.federation.payload import Payload
from rafl.federation.training import distill_kl, evaluate_accuracy, make_optimizer, predict_logits, train_ce


def group_of(model_key: str) -> str:
    """Stable short id of an architecture group (first 10 hex digits of its SHA-1)."""
    return hashlib.sha1(model_key.encode()).hexdigest()[:10]


class FedDFHparams(LocalTraining):
    """FedDF's hyperparameters (Lin et al., NeurIPS 2020): local training, then server distillation."""

    distill_epochs: Int = bounded(1, ge=1)
    distill_lr: Float = bounded(0.001, gt=0)
    distill_temperature: Float = bounded(1.0, gt=0)
    distill_batch_size: Int = bounded(64, ge=1)


@register
class FedDF(Algorithm):
    """FedDF (Lin et al. 2020). Server state ``{"groups": {group: state_dict}}``."""

    name: ClassVar[str] = "feddf"
    hparams_model: ClassVar[type[Hyperparameters]] = FedDFHparams
    uses_public_pool: ClassVar[bool] = True
    bn_statistics: ClassVar[str] = "averaged"

    def init_server(self, server: ServerContext):
        if server.public_images is None or len(server.public_images) == 0:
            raise UserInputError("feddf distils on the server's public pool, but the run has none "
                                 "(set partition.public_fraction > 0)", field="algorithm.name")
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for info in server.clients:
            g = group_of(info.model_key)
            if g not in groups:
                groups[g] = cpu_state(server.make_model(client_id=info.client_id))
        return {"groups": groups}, self._broadcast(groups)

    @staticmethod
    def _broadcast(groups) -> Payload:
        return Payload({f"{g}/{k}": v for g, sd in sorted(groups.items()) for k, v in sd.items()})

    def client_broadcast(self, broadcast: Payload, client: ClientInfo) -> Payload:
        return Payload(broadcast.state_dict(group_of(client.model_key) + "/"))

    def init_client(self, client: ClientContext):
        return {}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        model = build(client, broadcast.state_dict())
        train_ce(model, client.train_loader, optimizer_for(model, self.hparams),  # averaged whole: no BN recalibration
                 epochs=self.hparams["local_epochs"], device=client.device, bn_recalibration=False)
        return {}, Payload.from_state_dict(cpu_state(model), meta={"n_samples": client.n_samples})

    def upload_spec(self, server_state, client: ClientInfo):
        return {k: tuple(v.shape) for k, v in server_state["groups"][group_of(client.model_key)].items()}

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        groups = dict(server_state["groups"])
        if not uploads:
            return server_state, self._broadcast(groups)
        by_id = {c.client_id: c for c in server.clients}
        members: dict[str, list[Payload]] = {}
        for u in uploads:
            members.setdefault(group_of(by_id[int(u.meta["client_id"])].model_key), []).append(u)
        # every upload's update from its group's previous global is norm-bounded over the whole round (a
        # group may have one member, whose own median bounds nothing); the group averages and the
        # teachers use the bounded states
        bounded = clipped_states([u.tensors for u in uploads],
                                 [groups[group_of(by_id[int(u.meta["client_id"])].model_key)] for u in uploads],
                                 getattr(server, "aggregation", None), getattr(server, "clip_bounds", None))
        of_upload = {id(u): b for u, b in zip(uploads, bounded)}
        for g, ups in members.items():
            # already bounded over the round (and against the carried bound): no second, per-group history
            groups[g] = robust_average([of_upload[id(u)] for u in ups], payload_weights(ups),
                                       getattr(server, "aggregation", None), groups[g])
        images = server.public_images
        logits = []
        for u, weights in zip(uploads, bounded):
            teacher = server.make_model(client_id=int(u.meta["client_id"]))
            teacher.load_state_dict(weights)
            logits.append(predict_logits(teacher.to(server.device), images, device=server.device))
        targets = torch.stack(logits).mean(0)
        hp = self.hparams
        for g in sorted(members):
            cid = int(members[g][0].meta["client_id"])
            student = server.make_model(client_id=cid)
            student.load_state_dict(groups[g])
            student.to(server.device)
            opt = make_optimizer(student, "adam", lr=float(hp["distill_lr"]))
            gen = torch.Generator().manual_seed(int(server.seed))  # the round's server seed
            distill_kl(student, images, targets, opt, temperature=float(hp["distill_temperature"]),
                       epochs=int(hp["distill_epochs"]), batch_size=int(hp["distill_batch_size"]),
                       generator=gen, device=server.device)
            groups[g] = cpu_state(student)
        return {"groups": groups}, self._broadcast(groups)

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {"model": broadcast.state_dict()}

    def evaluate(self, state, client: ClientContext):
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(build(client, state["model"]), client.test_loader,
                                                       device=client.device))
