"""Pretrained: the no-training floor -- every client deploys its searched subnet as cut from the
supernet, BN recalibrated on the server's public pool, and never trains.

The row a federated method must beat to have learned anything from the clients: with a supernet
pretrained on the server's pool, a method that ends below it has done harm (the "no training"
reference of personalized-FL evaluations, e.g. the "Local"/"pretrained" rows of Tan et al.,
FedProto, AAAI 2022, Table 2). For model groups (no supernet) the deployed model is the freshly
initialized one, i.e. chance. Nothing is communicated: uploads and broadcasts are empty payloads
(0 bytes); rounds only sample clients, so its curve is flat: the engine evaluates it once, after the
last round (``static_models``).

Where each step lives: the deployed subnet, cut from the supernet and BN-recalibrated on the pool,
:meth:`rafl.supernet.bank.ModelBank.make` (the client's state :meth:`Standalone.init_client`); the
client step that keeps it :meth:`Pretrained.client_update`; evaluation :meth:`Standalone.evaluate`,
once, after the last round (``static_models``).
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.algorithms.base import ClientContext, register
from rafl.federation.algorithms.hparams import Hyperparameters
from rafl.federation.algorithms.standalone import Standalone
from rafl.federation.payload import Payload


@register
class Pretrained(Standalone):
    """No training at all: Standalone's client state and evaluation, a client step that returns the
    state unchanged. Client state: ``{"model": state_dict}`` of the subnet as built."""

    name: ClassVar[str] = "pretrained"
    hparams_model: ClassVar[type[Hyperparameters]] = Hyperparameters
    static_models: ClassVar[bool] = True
    bn_statistics: ClassVar[str] = "server"

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        return state, Payload()
