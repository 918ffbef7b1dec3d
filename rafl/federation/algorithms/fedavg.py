"""Whole-model averaging baselines: FedAvg, FedProx and FedNova.

All three average complete models, so every client must hold the *same* architecture
(:attr:`Algorithm.requires_homogeneous`; heterogeneous populations are rejected before round 1
with a UserInputError saying so).

* FedAvg -- McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017, Alg. 1: ``w <- sum_l (n_l / n) w_l``.
* Server momentum (FedAvgM) -- Hsu et al., "Measuring the Effects of Non-Identical Data Distribution
  for Federated Visual Classification", arXiv:1909.06335, 2019, Sec. 3; the server's SGD of FedOpt,
  Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 1: with the round's averaged update
  ``Delta^t = sum_l (n_l / n) w_l - w^t``, ``v^t = beta v^{t-1} + Delta^t`` and ``w^{t+1} = w^t + eta_s v^t``
  (``algorithm.server_momentum`` beta in [0, 1), ``algorithm.server_lr`` eta_s > 0) on the model's
  parameters; buffers (BatchNorm statistics) are averaged as in FedAvg. beta = 0 and eta_s = 1 (the
  defaults) are FedAvg itself, bit for bit.
* FedProx -- Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, Eq. 2:
  local objective ``F_l(w) + mu/2 ||w - w^t||^2``; aggregation as FedAvg.
* FedNova -- Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
  Federated Optimization", NeurIPS 2020, Eq. 6/Alg. 1: client ``l`` sends its normalized update
  ``d_l = (w^t - w_l) / ||a_l||_1`` (for SGD with momentum rho after tau_l steps,
  ``||a_l||_1 = (tau_l - rho (1 - rho^tau_l) / (1 - rho)) / (1 - rho)``; ``tau_l`` for plain
  SGD); the server steps ``w^{t+1} = w^t - tau_eff * sum_l p_l d_l`` with
  ``tau_eff = sum_l p_l ||a_l||_1`` and ``p_l = n_l / n``. Buffers (BatchNorm statistics) are
  averaged as in FedAvg.

Client state is ``{}`` (the model is the global one); server state ``{"global": state_dict}``, and
``"velocity"`` (the parameters' ``v^t``) when ``server_momentum`` > 0; evaluation uses the latest global model. Under
``train.bn_statistics: local`` (FedBN, Li et al., ICLR 2021, Alg. 1) the client state is ``{"bn": its
BatchNorm layers}`` after its first training, put into every download it trains or is scored on
(:func:`rafl.federation.bn_statistics.with_own_bn`).

Where each step lives: local training :meth:`FedAvg.client_update` (:meth:`FedAvg._local_train`;
FedProx's proximal term :meth:`FedProx._local_train`; FedNova's normalized update
:meth:`FedNova.client_update`); the weighted average :meth:`FedAvg.server_aggregate`
(:func:`rafl.federation.aggregation.server_average`; the server's momentum step
:meth:`FedAvg._server_step`; FedNova's step
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


def parameter_keys(server: ServerContext, client_id: int) -> set[str]:
    """The state-dict keys of the global model's parameters (the rest are buffers: BatchNorm statistics),
    from a model built for ``client_id``: what the server steps (FedAvgM, FedNova) move."""
    return {k for k, _ in server.make_model(client_id=client_id).named_parameters()}


class FedAvgHparams(LocalTraining):
    """FedAvg's hyperparameters: local training, and the server's step on the round's averaged update
    (FedAvgM; module docstring). The defaults are plain FedAvg."""

    server_lr: Float = bounded(1.0, gt=0)  # eta_s
    server_momentum: Float = bounded(0.0, ge=0, lt=1, description="a number in [0, 1)")  # beta


@register
class FedAvg(Algorithm):
    """FedAvg (McMahan et al. 2017, Alg. 1). Server state ``{"global": state_dict}`` (and ``"velocity"``
    under FedAvgM's server momentum, an option: module docstring)."""

    name: ClassVar[str] = "fedavg"
    evaluates_state_only: ClassVar[bool] = True
    hparams_model: ClassVar[type[Hyperparameters]] = FedAvgHparams
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
        state = self._server_step(server_state, new, server, int(uploads[0].meta["client_id"]))
        return state, Payload.from_state_dict(state["global"])

    def _server_step(self, server_state, average: dict[str, torch.Tensor], server: ServerContext,
                     client_id: int) -> dict:
        """The next server state from the round's average: the average itself (FedAvg), or with
        ``server_lr`` != 1 or ``server_momentum`` > 0 FedAvgM's step on the parameters
        (``v^t = beta v^{t-1} + (average - w^t)``, ``w^{t+1} = w^t + eta_s v^t``; module docstring);
        buffers take the average."""
        lr, beta = float(self.hparams.get("server_lr", 1.0)), float(self.hparams.get("server_momentum", 0.0))
        if lr == 1.0 and beta == 0.0:
            return {"global": average}
        old, velocity = server_state["global"], server_state.get("velocity", {})
        params = parameter_keys(server, client_id)
        new, moved = {}, {}
        for k, v in average.items():
            if k not in params:
                new[k] = v
                continue
            step = v.float() - old[k].float()
            moved[k] = beta * velocity[k] + step if k in velocity else step
            new[k] = (old[k].float() + lr * moved[k]).to(old[k].dtype)
        return {"global": new, "velocity": moved} if beta > 0 else {"global": new}

    def upload_spec(self, server_state, client: ClientInfo):
        return {k: tuple(v.shape) for k, v in server_state["global"].items()}

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {"model": self._start(state, broadcast)}

    def evaluate(self, state, client: ClientContext):
        model = build(client, state["model"])
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(model, client.test_loader, device=client.device))


class FedProxHparams(FedAvgHparams):
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
    #: its own server step (tau_eff): no server momentum
    hparams_model: ClassVar[type[Hyperparameters]] = LocalTraining
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
        params = parameter_keys(server, int(uploads[0].meta["client_id"]))
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
