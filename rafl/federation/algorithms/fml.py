"""FML: Federated Mutual Learning.

Shen et al., "Federated Mutual Learning", 2020. Every client has a private model (its own
architecture: a NAS subnet or a model of a heterogeneous group) and a copy of the shared *meme*
model (one architecture for all: the search space's knowledge subnet, default the smallest, or the
model group's ``"knowledge"`` model). Locally they learn from each other (Eqs. 1-2):

    L_private = alpha * CE(p_private, y) + (1 - alpha) * KL(p_meme || p_private)
    L_meme    = beta  * CE(p_meme, y)    + (1 - beta)  * KL(p_private || p_meme)

(:func:`rafl.federation.training.train_mutual`); only the meme model is uploaded and the server
averages it weighted by ``n_k / sum n`` (FedAvg). Reported: ``model`` (private) and ``global`` (meme).
Tensor names: ``global.<state_dict key>``.

Where each step lives: mutual learning (Eqs. 1-2) and the meme model's upload
:meth:`FML.client_update` (:func:`rafl.federation.training.train_mutual`); the average
:meth:`FML.server_aggregate`; the shared model :func:`shared_model`, its first broadcast
:meth:`PrivateAndSharedModel.init_server`; evaluation
:meth:`PrivateAndSharedModel.prepare_evaluation` and :meth:`PrivateAndSharedModel.evaluate` (FedKD
shares them).
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.aggregation import server_average
from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Accuracy, Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, LocalTraining, Text, bounded
from rafl.federation.algorithms.rafl import resolve_knowledge_arch
from rafl.federation.payload import Payload
from rafl.federation.training import evaluate_accuracy, train_mutual

PREFIX = "global."
#: the shared model's accuracy (FML's meme model, FedKD's mentee)
SHARED_MODEL = Accuracy("global", "shared model", "shared model accuracy", "shared")


def shared_model(make_model, space, spec: str):
    """The shared model of FML/FedKD: subnet ``spec`` of the supernet, or the model group's
    ``"knowledge"`` model when there is no search space."""
    arch = resolve_knowledge_arch(str(spec), space)
    return make_model(arch if arch is not None else "knowledge")


class FMLHparams(LocalTraining):
    """FML's hyperparameters (Shen et al., 2020). ``alpha`` and ``beta`` are fractions in [0, 1]:
    Eqs. 1-2 weight the cross-entropy by them and the KL term by ``1 - alpha`` / ``1 - beta``, so a
    value outside would push a model away from its labels or from its partner."""

    alpha: Float = bounded(0.5, ge=0, le=1, description="a fraction in [0, 1] (the CE weight; the KL term gets "
                                                        "1 - alpha)")  # CE weight of the private model
    beta: Float = bounded(0.5, ge=0, le=1, description="a fraction in [0, 1] (the CE weight; the KL term gets "
                                                       "1 - beta)")  # CE weight of the meme model
    temperature: Float = bounded(1.0, gt=0)
    knowledge_arch: Text = "smallest"  # the meme model (NAS: smallest | middle | largest | arch string)


class PrivateAndSharedModel(Algorithm):
    """The mutual-learning pair of FML (Shen et al., 2020) and FedKD (Wu et al., 2022): each client
    keeps a private model of its own architecture (client state ``{"local": state_dict}``) and
    learns with a copy of one shared model (``knowledge_arch``) that the server holds (server state
    ``{"global": state_dict}``) and broadcasts as ``global.<state_dict key>``. Evaluated: the
    private model (``model``) and, once broadcast, the shared one (``global``). Subclasses add the
    local step (:meth:`client_update`) and the merge (:meth:`server_aggregate`)."""

    accuracies: ClassVar[tuple[Accuracy, ...]] = (DEPLOYED, SHARED_MODEL)

    def init_server(self, server: ServerContext):
        glob = cpu_state(shared_model(server.make_model, server.space, self.hparams["knowledge_arch"]))
        return {"global": glob}, Payload.from_state_dict(glob, PREFIX)

    def init_client(self, client: ClientContext):
        return {"local": cpu_state(client.make_model())}

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {**state, "global": broadcast.state_dict(PREFIX)}

    def evaluate(self, state, client: ClientContext):
        out = eval_counts(DEPLOYED.prefix, *evaluate_accuracy(build(client, state["local"]), client.test_loader,
                                                      device=client.device))
        if state.get("global"):
            meme = shared_model(client.make_model, client.space, self.hparams["knowledge_arch"])
            meme.load_state_dict(state["global"], strict=True)
            out.update(eval_counts("global", *evaluate_accuracy(meme.to(client.device), client.test_loader,
                                                                device=client.device)))
        return out


@register
class FML(PrivateAndSharedModel):
    """FML (Shen et al., 2020). Client state ``{"local": state_dict}``; server ``{"global": state_dict}``."""

    name: ClassVar[str] = "fml"
    hparams_model: ClassVar[type[Hyperparameters]] = FMLHparams

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        local = build(client, state["local"])
        meme = shared_model(client.make_model, client.space, hp["knowledge_arch"])
        meme.load_state_dict(broadcast.state_dict(PREFIX), strict=True)
        meme.to(client.device).train()
        a, b = float(hp["alpha"]), float(hp["beta"])
        train_mutual(local, meme, client.train_loader, optimizer_for(local, hp), optimizer_for(meme, hp),
                     epochs=hp["local_epochs"], ce_a=a, kl_a=1 - a, ce_b=b, kl_b=1 - b,
                     temperature=float(hp["temperature"]), device=client.device)
        return {"local": cpu_state(local)}, Payload.from_state_dict(cpu_state(meme), PREFIX,
                                                                    meta={"n_samples": client.n_samples})

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        glob = (server_average([u.state_dict(PREFIX) for u in uploads], uploads, server, reference=server_state["global"])
                if uploads else server_state["global"])
        return {"global": glob}, Payload.from_state_dict(glob, PREFIX)

    def upload_spec(self, server_state, client):
        return {PREFIX + k: tuple(v.shape) for k, v in server_state["global"].items()}
