"""LG-FedAvg: local representations, global (averaged) header.

Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", 2020. Each client keeps its own feature extractor (any architecture) and shares
only the top layers -- here the header ``head: (B, D) -> (B, K)``, which every client must have
in the same shape (checked before round 1). Per round: the client loads the global header,
trains its whole model with cross-entropy, and uploads its header with ``n_samples``; the
server averages the headers weighted by ``n_k / sum n`` (FedAvg, McMahan et al. 2017, Alg. 1).

Upload/broadcast tensors: ``head.<key>``.

Where each step lives: the global header loaded and the whole model trained
:meth:`LGFedAvg.client_update`; the header average :meth:`LGFedAvg.server_aggregate`; the global
header loaded before evaluation :meth:`LGFedAvg.prepare_evaluation`; evaluation
:meth:`LGFedAvg.evaluate`.
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.aggregation import server_average
from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Hyperparameters, LocalTraining
from rafl.federation.headers import common_header, head_state, load_head
from rafl.federation.payload import Payload
from rafl.federation.training import NoSingletonBatches, evaluate_accuracy, train_ce

HEAD = "head."





@register
class LGFedAvg(Algorithm):
    """LG-FedAvg with a global header. Client state ``{"model": state_dict}``; server ``{"head": ...}``."""

    name: ClassVar[str] = "lg-fedavg"
    hparams_model: ClassVar[type[Hyperparameters]] = LocalTraining

    def init_server(self, server: ServerContext):
        head = head_state(common_header(server.make_model, server.clients, self.name))
        return {"head": head}, Payload.from_state_dict(head, HEAD)

    def init_client(self, client: ClientContext):
        return {"model": cpu_state(client.make_model())}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        model = build(client, state["model"])
        load_head(model, broadcast.state_dict(HEAD), f"client {client.client_id} head")
        train_ce(model, NoSingletonBatches(client.train_loader), optimizer_for(model, self.hparams),
                 epochs=self.hparams["local_epochs"], device=client.device)
        return {"model": cpu_state(model)}, Payload.from_state_dict(head_state(model), HEAD,
                                                                     meta={"n_samples": client.n_samples})

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        if uploads:
            head = server_average([u.state_dict(HEAD) for u in uploads], uploads, server, reference=server_state["head"])
        else:
            head = server_state["head"]
        return {"head": head}, Payload.from_state_dict(head, HEAD)

    def upload_spec(self, server_state, client):
        return {HEAD + k: tuple(v.shape) for k, v in server_state["head"].items()}

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        model = build(client, state["model"])
        load_head(model, broadcast.state_dict(HEAD), f"client {client.client_id} head")
        return {"model": cpu_state(model)}

    def evaluate(self, state, client: ClientContext):
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(build(client, state["model"]), client.test_loader,
                                                       device=client.device))
