"""FedKD: communication-efficient FL via adaptive mutual knowledge distillation.

Wu et al., "Communication-efficient federated learning via knowledge distillation", Nature
Communications 2022. Every client has a private *mentor* (its own architecture) and a copy of the
shared small *mentee*. Locally (Eqs. 1-4, :func:`rafl.federation.training.train_mutual` with
``adaptive=True``):

    L_mentor = CE_t + (KL(p_s || p_t) + MSE(h_t, h_s)) / (CE_t + CE_s)
    L_mentee = CE_s + (KL(p_t || p_s) + MSE(h_s, h_t)) / (CE_t + CE_s)

(adaptive distillation: the better both predict, the more they trust each other; the hidden loss
uses the representations, which have the same width D for every model here, so no projection).
Only the mentee's *update* ``Delta = theta_s' - theta_s`` is uploaded, compressed by truncated SVD
(Sec. "Dynamic gradient approximation"): each matrix (conv kernels reshaped to ``(out, -1)``)
keeps the smallest rank whose singular values hold an energy share ``>= T`` (``sum s_i^2``),
with ``T`` growing linearly from ``energy_start`` to ``energy_end`` over ``energy_rounds`` rounds.
Vectors (biases, BN) travel uncompressed. The server rebuilds the updates, averages them weighted by
``n_k / sum n`` and adds them to the mentee. The download is the full mentee (uncompressed here).

Reported: ``model`` (the mentor) and ``global`` (the mentee).

As in HtFLlib's FedKD client (not in the paper), each model's gradient is clipped to norm
``max_grad_norm`` (10; 0 = off): the adaptive scale ``1 / (CE_t + CE_s)`` grows without bound as
both models fit their data, and with it the distillation gradients.

Where each step lives: adaptive mutual distillation (Eqs. 1-4) and the compressed upload
:meth:`FedKD.client_update` (:func:`compress_update`, the energy threshold :meth:`FedKD._energy`);
the upload's check :meth:`FedKD.check_upload`; the rebuilt updates averaged and added to the mentee
:meth:`FedKD.server_aggregate` (:func:`decompress_update`); evaluation
:meth:`PrivateAndSharedModel.prepare_evaluation` and :meth:`PrivateAndSharedModel.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation.aggregation import server_average
from rafl.federation.algorithms._common import build, cpu_state, optimizer_for
from rafl.federation.algorithms.base import ClientContext, ServerContext, register
from rafl.federation.algorithms.fml import PrivateAndSharedModel, shared_model
from rafl.federation.algorithms.hparams import Float, Hyperparameters, Int, LocalTraining, Text, bounded, fraction
from rafl.federation.payload import Payload
from rafl.federation.training import train_mutual

PREFIX = "global."
UPD = "upd."


def svd_rank(singular_values: torch.Tensor, energy: float) -> int:
    """Smallest r with ``sum_{i<r} s_i^2 >= energy * sum s_i^2`` (at least 1)."""
    e = singular_values.double().pow(2)
    total = float(e.sum())
    if total <= 0:
        return 1
    cum = torch.cumsum(e, 0) / total
    return int(min(len(e), int(torch.searchsorted(cum, torch.tensor(energy - 1e-12, dtype=cum.dtype))) + 1))


def compress_update(delta: dict[str, torch.Tensor], energy: float) -> dict[str, torch.Tensor]:
    """Truncated-SVD compression of a model update (FedKD's dynamic gradient approximation).

    Args:
        delta: ``name -> update tensor``.
        energy: T in (0, 1].

    Returns:
        ``name.u (m, r)`` (= U S) and ``name.v (r, n)`` for floating tensors with ndim >= 2 when that
        is smaller than the tensor, else ``name`` itself.
    """
    out: dict[str, torch.Tensor] = {}
    for k, d in delta.items():
        if d.is_floating_point() and d.ndim >= 2:
            m = d.reshape(d.shape[0], -1).double()
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            r = svd_rank(s, energy)
            if r * (m.shape[0] + m.shape[1]) < m.numel():
                out[k + ".u"] = (u[:, :r] * s[:r]).float()
                out[k + ".v"] = vh[:r].float()
                continue
        out[k] = d
    return out


def decompress_update(tensors: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`compress_update` given the original ``name -> shape``."""
    out = {}
    for k, shape in shapes.items():
        if k + ".u" in tensors:
            out[k] = (tensors[k + ".u"].double() @ tensors[k + ".v"].double()).reshape(shape).float()
        else:
            out[k] = tensors[k]
    return out


class FedKDHparams(LocalTraining):
    """FedKD's hyperparameters (Wu et al., Nat. Commun. 2022): adaptive mutual distillation and the
    SVD energy threshold T of the mentee's update (Eq. 9), raised from ``energy_start`` to
    ``energy_end`` over ``energy_rounds`` rounds."""

    temperature: Float = bounded(1.0, gt=0)
    hidden_weight: Float = bounded(1.0, ge=0)   # weight of the hidden (representation) loss
    max_grad_norm: Float = bounded(10.0, ge=0)  # clip each model's gradient (HtFLlib); 0 = off (the paper)
    energy_start: Float = fraction(0.95)        # SVD energy threshold T at round 1
    energy_end: Float = fraction(0.98)          # ... reached after energy_rounds rounds
    energy_rounds: Int = bounded(10, ge=1)
    knowledge_arch: Text = "smallest"           # the mentee


@register
class FedKD(PrivateAndSharedModel):
    """FedKD (Wu et al., 2022). Client state ``{"local": state_dict}``; server ``{"global": state_dict}``."""

    name: ClassVar[str] = "fedkd"
    hparams_model: ClassVar[type[Hyperparameters]] = FedKDHparams
    uploads_bn_statistics: ClassVar[bool] = False  # the mentee's compressed deltas: a variance's update may be < 0

    def _energy(self, rnd: int) -> float:
        hp = self.hparams
        frac = min(1.0, max(0.0, (rnd - 1) / max(1, int(hp["energy_rounds"]) - 1)))
        return float(hp["energy_start"]) + frac * (float(hp["energy_end"]) - float(hp["energy_start"]))

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        local = build(client, state["local"])
        start = broadcast.state_dict(PREFIX)
        mentee = shared_model(client.make_model, client.space, hp["knowledge_arch"])
        mentee.load_state_dict(start, strict=True)
        mentee.to(client.device).train()
        train_mutual(local, mentee, client.train_loader, optimizer_for(local, hp), optimizer_for(mentee, hp),
                     epochs=hp["local_epochs"], temperature=float(hp["temperature"]), adaptive=True,
                     hidden_weight=float(hp["hidden_weight"]), max_grad_norm=float(hp["max_grad_norm"]),
                     device=client.device)
        new = cpu_state(mentee)
        delta = {k: (new[k] - start[k]) if new[k].is_floating_point() else new[k] for k in new}
        upload = Payload({UPD + k: v for k, v in compress_update(delta, self._energy(client.round)).items()},
                         meta={"n_samples": client.n_samples})
        return {"local": cpu_state(local)}, upload

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        glob = server_state["global"]
        if not uploads:
            return server_state, Payload.from_state_dict(glob, PREFIX)
        shapes = {k: v.shape for k, v in glob.items()}
        deltas = [decompress_update(u.state_dict(UPD), shapes) for u in uploads]
        mean = server_average(deltas, uploads, server)  # the deltas are updates
        new = {k: (glob[k] + mean[k].to(glob[k].dtype)) if glob[k].is_floating_point() else mean[k] for k in glob}
        return {"global": new}, Payload.from_state_dict(new, PREFIX)

    def check_upload(self, upload, server_state, client, n_classes):
        """The compressed update covers the mentee exactly: for every tensor ``k`` of shape
        ``(m, *rest)`` either ``upd.k`` of that shape or the factors ``upd.k.u (m, r)`` and
        ``upd.k.v (r, prod(rest))`` (:func:`compress_update`), and nothing else."""
        tensors = upload.state_dict(UPD)
        seen: set[str] = set()
        for k, v in server_state["global"].items():
            shape = tuple(v.shape)
            if k in tensors:
                seen.add(k)
                if tuple(tensors[k].shape) != shape:
                    raise UserInputError(f"has shape {list(tensors[k].shape)}; allowed: {list(shape)} (the mentee's "
                                         f"{k})", field=UPD + k)
                continue
            u, w = tensors.get(k + ".u"), tensors.get(k + ".v")
            if u is None or w is None:
                raise UserInputError(f"is missing; allowed: {UPD + k} {list(shape)} or its SVD factors "
                                     f"{UPD + k}.u / {UPD + k}.v", field=UPD + k)
            seen |= {k + ".u", k + ".v"}
            rest = int(v.numel() // max(1, shape[0])) if shape else 1
            if (len(shape) < 2 or u.ndim != 2 or w.ndim != 2 or u.shape[0] != shape[0] or u.shape[1] != w.shape[0]
                    or w.shape[1] != rest):
                raise UserInputError(f"factors have shapes {list(u.shape)} and {list(w.shape)}; allowed: "
                                     f"[{shape[0] if shape else 1}, r] and [r, {rest}] (the mentee's {k} "
                                     f"{list(shape)})", field=UPD + k)
        extra = sorted(set(tensors) - seen)
        if extra:
            raise UserInputError(f"unexpected tensor(s) {[UPD + k for k in extra[:5]]}; allowed: the mentee's "
                                 "tensors or their SVD factors", field=UPD + extra[0])
