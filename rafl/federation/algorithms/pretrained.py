"""Pretrained: the no-training floor -- every client deploys its searched subnet as cut from the
supernet, BN recalibrated on the server's public pool, and never trains.

The row a federated method must beat to have learned anything from the clients: with a supernet
pretrained on the server's pool, a method that ends below it has done harm (the "no training"
reference of personalized-FL evaluations, e.g. the "Local"/"pretrained" rows of Tan et al.,
FedProto, AAAI 2022, Table 2). For model groups (no supernet) the deployed model is the freshly
initialized one, i.e. chance. Nothing is communicated: uploads and broadcasts are empty payloads
(0 bytes); rounds only sample clients, so its curve is flat.
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.algorithms._common import build, cpu_state, eval_counts
from rafl.federation.algorithms.base import Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Hyperparameters
from rafl.federation.payload import Payload
from rafl.federation.training import evaluate_accuracy


@register
class Pretrained(Algorithm):
    """No training at all. Client state: ``{"model": state_dict}`` of the subnet as built."""

    name: ClassVar[str] = "pretrained"
    hparams_model: ClassVar[type[Hyperparameters]] = Hyperparameters

    def init_server(self, server: ServerContext):
        return {}, Payload()

    def init_client(self, client: ClientContext):
        return {"model": cpu_state(client.make_model())}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        return state, Payload()

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        return server_state, Payload()

    def evaluate(self, state, client: ClientContext):
        return eval_counts("model", *evaluate_accuracy(build(client, state["model"]), client.test_loader,
                                                       device=client.device))
