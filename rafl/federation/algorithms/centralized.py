"""Centralized: the ceiling federation chases -- each device tier's subnet trained on the pooled client
training data, for the same number of image-steps as the federation.

Not a federated method: an oracle row (issue 56, item 4; the "centralized" upper bound of FL
evaluations, e.g. McMahan et al., AISTATS 2017, Sec. 3, and HeteroFL, Diao et al., ICLR 2021,
Table 2). Every round, each sampled client sends its training images and labels to the server (its
upload is its data: the communication column counts it), and the server trains one model per
architecture (``ClientInfo.model_key``: one per device tier) on the pooled uploads of the round:
``local_epochs`` passes over them in shuffled mini-batches of ``batch_size``, cross-entropy with the
local optimizer's hyperparameters (:func:`rafl.federation.training.train_ce`), ending with BN
statistics re-estimated on the pooled data. So in a round every tier's model takes as many image-steps
as the federation's clients take together (``local_epochs x`` the sampled clients' training images),
and over the rounds it sees the data every client holds. Each client deploys its tier's model.

The server's shuffle draws from a generator seeded by the round's server seed, so a run is
deterministic. State: client ``{}``; server ``{"models": {model_key: state_dict}, "shape": [C, H, W] or
None}``. Broadcast: model ``i`` of ``meta["keys"]`` (JSON list) as ``<i>.<key>``; a client downloads
only its own tier's. Upload: ``images`` (n, C, H, W) float32 and ``labels`` (n,) int64 of the client's
training split, meta ``n_samples``.

Where each step lives: the upload of a client's training data :meth:`Centralized.client_update`; the
server's training of each tier's model on the round's pooled data
:meth:`Centralized.server_aggregate` (:func:`rafl.federation.training.train_ce`); the tier's model a
client downloads :meth:`Centralized.client_broadcast`; evaluation
:meth:`Centralized.prepare_evaluation` and :meth:`Centralized.evaluate`.
"""

from __future__ import annotations

import json
from typing import ClassVar

import torch

from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Algorithm, ClientContext, ClientInfo, ServerContext, register
from rafl.federation.algorithms.hparams import Hyperparameters, Int, LocalTraining, bounded
from rafl.federation.payload import Payload
from rafl.federation.training import evaluate_accuracy, train_ce


class CentralizedHparams(LocalTraining):
    """The server's training: the local-training keys, and its mini-batch size (the run's
    ``train.batch_size`` default, 32)."""

    batch_size: Int = bounded(32, ge=2)


@register
class Centralized(Algorithm):
    """Each tier's subnet trained on the pooled client data by the server (module docstring)."""

    name: ClassVar[str] = "centralized"
    hparams_model: ClassVar[type[Hyperparameters]] = CentralizedHparams
    #: the deployed statistics: re-estimated on the pooled client data
    bn_statistics: ClassVar[str] = "pooled"
    #: a client deploys its tier's model as broadcast: clients of one tier score alike on the global set
    evaluates_state_only: ClassVar[bool] = True

    def _server_model(self, server: ServerContext, info: ClientInfo) -> torch.nn.Module:
        if info.arch is not None:
            return server.make_model(arch=info.arch)
        return server.make_model(client_id=info.client_id)

    def _broadcast(self, state, round_: int) -> Payload:
        keys = sorted(state["models"])
        tensors = {f"{i}.{k}": t for i, key in enumerate(keys) for k, t in state["models"][key].items()}
        return Payload(tensors, {"round": int(round_), "keys": json.dumps(keys)})

    def init_server(self, server: ServerContext):
        models: dict[str, dict[str, torch.Tensor]] = {}
        for c in server.clients:
            if c.model_key not in models:
                models[c.model_key] = cpu_state(self._server_model(server, c))
        pool = server.public_images
        shape = list(pool.shape[1:]) if pool is not None and len(pool) else None
        state = {"models": models, "shape": shape}
        return state, self._broadcast(state, 1)

    def client_broadcast(self, broadcast: Payload, client: ClientInfo) -> Payload:
        keys = json.loads(str(broadcast.meta["keys"]))
        prefix = f"{keys.index(client.model_key)}."
        return Payload({k[len(prefix):]: t for k, t in broadcast.tensors.items() if k.startswith(prefix)},
                       {"round": int(broadcast.meta["round"])})

    def init_client(self, client: ClientContext):
        return {}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        images, labels = [], []
        for x, y in client.train_loader:
            images.append(x.float())
            labels.append(y.long())
        upload = {"images": torch.cat(images) if images else torch.zeros(0),
                  "labels": torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64)}
        return {}, Payload(upload, {"n_samples": client.n_samples})

    def upload_spec(self, server_state, client: ClientInfo):
        shape = server_state.get("shape")
        if shape is None:
            return None
        return {"images": (int(client.n_samples), *map(int, shape)), "labels": (int(client.n_samples),)}

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        rnd = int(server.round)
        held = [u for u in uploads if len(u.tensors.get("labels", ())) > 0]
        if not held:
            return server_state, self._broadcast(server_state, rnd + 1)
        images = torch.cat([u.tensors["images"] for u in held])
        labels = torch.cat([u.tensors["labels"] for u in held])
        hp = self.hparams
        size = int(hp["batch_size"])
        models = {}
        for i, key in enumerate(sorted(server_state["models"])):
            g = torch.Generator().manual_seed(int(server.seed) + i)
            batches = []
            for _ in range(int(hp["local_epochs"])):
                order = torch.randperm(len(labels), generator=g)
                batches += [(images[order[j:j + size]], labels[order[j:j + size]]) for j in range(0, len(order), size)]
            info = next(c for c in server.clients if c.model_key == key)
            model = self._server_model(server, info)
            model.load_state_dict(server_state["models"][key])
            model.to(server.device).train()
            train_ce(model, batches, optimizer_for(model, hp), epochs=1, device=server.device)
            models[key] = cpu_state(model)
        state = {**server_state, "models": models}
        return state, self._broadcast(state, rnd + 1)

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {"model": dict(broadcast.tensors)}

    def evaluate(self, state, client: ClientContext):
        weights = state.get("model")
        model = build(client, weights) if weights else build(client)
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(model, client.test_loader, device=client.device))


__all__ = ["Centralized"]
