"""Standalone: every client trains only on its own data; nothing is communicated.

The lower baseline of RaFL's evaluation (Yu et al., Sec. V, "local training only"): each client
keeps its specialized subnet and trains it with cross-entropy. Uploads and broadcasts are empty
payloads (0 bytes).

Where each step lives: local training :meth:`Standalone.client_update`; the server step, which
passes nothing on, :meth:`Standalone.server_aggregate`; evaluation :meth:`Standalone.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Hyperparameters, LocalTraining
from rafl.federation.payload import Payload
from rafl.federation.training import evaluate_accuracy, train_ce


@register
class Standalone(Algorithm):
    """Local training only. Client state: ``{"model": state_dict}``."""

    name: ClassVar[str] = "standalone"
    evaluates_state_only: ClassVar[bool] = True
    hparams_model: ClassVar[type[Hyperparameters]] = LocalTraining

    def init_server(self, server: ServerContext):
        return {}, Payload()

    def init_client(self, client: ClientContext):
        return {"model": cpu_state(client.make_model())}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        model = build(client, state["model"])
        train_ce(model, client.train_loader, optimizer_for(model, self.hparams),
                 epochs=self.hparams["local_epochs"], device=client.device)
        return {"model": cpu_state(model)}, Payload()

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        return server_state, Payload()

    def evaluate(self, state, client: ClientContext):
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(build(client, state["model"]), client.test_loader,
                                                       device=client.device))
