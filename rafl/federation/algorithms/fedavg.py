"""Whole-model averaging baselines: FedAvg, FedProx and FedNova.

All three average complete models, so every client must hold the *same* architecture
(:attr:`Algorithm.requires_homogeneous`; heterogeneous populations are rejected before round 1
with a UserInputError saying so).

* FedAvg -- McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017, Alg. 1: ``w <- sum_l (n_l / n) w_l``.
* FedProx -- Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, Eq. 2:
  local objective ``F_l(w) + mu/2 ||w - w^t||^2``; aggregation as FedAvg.
* FedNova -- Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
  Federated Optimization", NeurIPS 2020, Eq. 6/Alg. 1: client ``l`` sends its normalized update
  ``d_l = (w^t - w_l) / ||a_l||_1`` (for SGD with momentum rho after tau_l steps,
  ``||a_l||_1 = (tau_l - rho (1 - rho^tau_l) / (1 - rho)) / (1 - rho)``; ``tau_l`` for plain
  SGD); the server steps ``w^{t+1} = w^t - tau_eff * sum_l p_l d_l`` with
  ``tau_eff = sum_l p_l ||a_l||_1`` and ``p_l = n_l / n``. Buffers (BatchNorm statistics) are
  averaged as in FedAvg.

Client state is ``{}`` (the model is the global one); evaluation uses the latest global model. Under
``train.bn_statistics: local`` (FedBN, Li et al., ICLR 2021, Alg. 1) the client state is ``{"bn": its
BatchNorm layers}`` after its first training, put into every download it trains or is scored on
(:func:`rafl.federation.bn_statistics.with_own_bn`).

Where each step lives: local training :meth:`FedAvg.client_update` (:meth:`FedAvg._local_train`;
FedProx's proximal term :meth:`FedProx._local_train`; FedNova's normalized update
:meth:`FedNova.client_update`); the weighted average :meth:`FedAvg.server_aggregate`
(:func:`rafl.federation.aggregation.server_average`; FedNova's step
:meth:`FedNova.server_aggregate`); FedBN's own BN layers :meth:`FedAvg._start` and
:meth:`FedAvg._kept`; evaluation :meth:`FedAvg.prepare_evaluation` and :meth:`FedAvg.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rafl.federation.aggregation import clip_scales, payload_weights, server_average
from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Algorithm, ClientContext, ClientInfo, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, LocalTraining, bounded
from rafl.federation.bn_statistics import own_bn, with_own_bn
from rafl.federation.payload import Payload
from rafl.federation.training import evaluate_accuracy, train_ce


@register
class FedAvg(Algorithm):
    """FedAvg (McMahan et al. 2017, Alg. 1). Server state ``{"global": state_dict}``."""

    name: ClassVar[str] = "fedavg"
    evaluates_state_only: ClassVar[bool] = True
    hparams_model: ClassVar[type[Hyperparameters]] = LocalTraining
    requires_homogeneous: ClassVar[bool] = True
    global_model: ClassVar[bool] = True
    bn_statistics: ClassVar[str] = "averaged"

    def supports_local_bn(self) -> bool:
        return True

    def _start(self, state, broadcast: Payload) -> dict[str, torch.Tensor]:
        """The weights a client starts from: the broadcast, with its own BN layers under FedBN."""
        weights = broadcast.state_dict()
        return with_own_bn(weights, state.get("bn")) if self.bn_policy == "local" else weights

    def _kept(self, model) -> dict:
        """The client state after training: its BN layers under FedBN, else nothing."""
        return {"bn": own_bn(model)} if self.bn_policy == "local" else {}

    def init_server(self, server: ServerContext):
        first = server.clients[0].client_id if server.clients else 0
        global_sd = cpu_state(server.make_model(client_id=first))
        return {"global": global_sd}, Payload.from_state_dict(global_sd)

    def init_client(self, client: ClientContext):
        return {}

    def _local_train(self, model, broadcast: Payload, client: ClientContext):
        # the whole model, BN statistics included, is averaged on the server: no per-client BN
        # recalibration (averaging purely local statistics measured worse than averaging the
        # running estimates; see recalibrate_local_bn)
        return train_ce(model, client.train_loader, optimizer_for(model, self.hparams),
                        epochs=self.hparams["local_epochs"], device=client.device, bn_recalibration=False)

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        model = build(client, self._start(state, broadcast))
        self._local_train(model, broadcast, client)
        return self._kept(model), Payload.from_state_dict(cpu_state(model), meta={"n_samples": client.n_samples})

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        if not uploads:
            return server_state, Payload.from_state_dict(server_state["global"])
        new = server_average([u.tensors for u in uploads], uploads, server, reference=server_state["global"])
        return {"global": new}, Payload.from_state_dict(new)

    def upload_spec(self, server_state, client: ClientInfo):
        return {k: tuple(v.shape) for k, v in server_state["global"].items()}

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {"model": self._start(state, broadcast)}

    def evaluate(self, state, client: ClientContext):
        model = build(client, state["model"])
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(model, client.test_loader, device=client.device))


class FedProxHparams(LocalTraining):
    """FedProx's hyperparameters (Li et al., MLSys 2020, Eq. 2)."""

    mu: Float = bounded(0.01, ge=0)  # weight of the proximal term (mu / 2) ||w - w_t||^2


@register
class FedProx(FedAvg):
    """FedProx (Li et al. 2020, Eq. 2): FedAvg with the proximal term ``mu/2 ||w - w^t||^2``."""

    name: ClassVar[str] = "fedprox"
    hparams_model: ClassVar[type[Hyperparameters]] = FedProxHparams

    def _local_train(self, model, broadcast: Payload, client: ClientContext):
        reference = {k: v.detach().clone() for k, v in model.named_parameters()}
        return train_ce(model, client.train_loader, optimizer_for(model, self.hparams),
                        epochs=self.hparams["local_epochs"], device=client.device,
                        prox_mu=float(self.hparams["mu"]), prox_reference=reference, bn_recalibration=False)


def _a_norm(tau: int, rho: float) -> float:
    """``||a||_1`` of FedNova for tau local steps of SGD with momentum rho (Wang et al. 2020, Sec. 4)."""
    if tau <= 0:
        return 0.0
    if rho <= 0:
        return float(tau)
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


@register
class FedNova(FedAvg):
    """FedNova (Wang et al. 2020): normalized averaging of the clients' updates (see module doc)."""

    name: ClassVar[str] = "fednova"
    #: its upload is a normalized update, not a model: no fine-tuned variant from it
    global_model: ClassVar[bool] = False

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        start = self._start(state, broadcast)
        model = build(client, start)
        stats = self._local_train(model, broadcast, client)
        a_norm = _a_norm(stats.steps, float(self.hparams["momentum"]) if self.hparams["optimizer"] == "sgd" else 0.0)
        params = {k for k, _ in model.named_parameters()}
        out = {}
        for k, v in cpu_state(model).items():
            if k in params:  # normalized update d_l
                out[k] = (start[k].float() - v.float()) / max(a_norm, 1e-12)
            else:  # buffers travel as values
                out[k] = v
        return self._kept(model), Payload(out, {"n_samples": client.n_samples, "tau": int(stats.steps), "a_norm": float(a_norm)})

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        uploads = [u for u in uploads if float(u.meta.get("a_norm", 0.0)) > 0]
        if not uploads:
            return server_state, Payload.from_state_dict(server_state["global"])
        p = payload_weights(uploads)
        old = server_state["global"]
        model = server.make_model(client_id=int(uploads[0].meta["client_id"]))
        params = {k for k, _ in model.named_parameters()}
        a_norms = [float(u.meta["a_norm"]) for u in uploads]
        rule = getattr(server, "aggregation", None)
        if rule is not None and rule.name != "mean":  # a claimed a_norm scales the step: bounded like the updates
            a_norms = [a * s for a, s in zip(a_norms, clip_scales(a_norms))]
        tau_eff = sum(pi * a for pi, a in zip(p, a_norms))
        # params travel as normalized updates (reference 0), buffers as values (reference: the old ones)
        avg = server_average([u.tensors for u in uploads], uploads, server,
                             reference={k: torch.zeros_like(v) if k in params else v for k, v in old.items()})
        new = {}
        for k, v in old.items():
            new[k] = (v.float() - tau_eff * avg[k].float()).to(v.dtype) if k in params else avg[k]
        return {"global": new}, Payload.from_state_dict(new)
