"""The fine-tuned variant of a global-model method (``uniform-ft``, ``heterofl-ft``, ``fedrolex-ft``,
``fedavg-ft``): the final global model (or each client's slice of it) fine-tuned on the client's own
train split for the method's ``local_epochs``, then scored.

This is how personalized-FL papers put a global-model method on equal footing with personalized
ones ("FedAvg-FT": Collins et al., FedRep, ICML 2021, Sec. 5, Table 1; Chen & Chao, FedBABU,
ICLR 2022, Sec. 4): the personalized methods' clients adapt to their own label skew, so the global
model gets the same local epochs before it is scored. Fine-tuning is one more client step of the
method itself from the final broadcast (its ``client_update``, seeded like round ``rounds + 1``);
the resulting upload, a whole model or slice for these methods, is evaluated as a broadcast. The
server never sees it, so the communicated bytes are the base method's.
"""

from __future__ import annotations

import torch

from rafl.errors import UserInputError
from rafl.federation.payload import Payload
from rafl.federation.runners import Federation, client_context, evaluate_state, naming_client


def finetune_evaluate(fed: Federation, seed: int, rnd: int, broadcast: Payload,
                      clients: list[int] | None = None) -> dict[int, dict[str, float]]:
    """Fine-tune the final global model on every client and evaluate it.

    Args:
        fed: the method's federation (its algorithm must have ``global_model``).
        seed: the run seed.
        rnd: the round number whose seeds the fine-tuning uses (``rounds + 1``).
        broadcast: the final round's broadcast (the global model).
        clients: which clients (default all).

    Returns:
        ``{client id: counts}`` in the evaluation contract (``model.correct``/``model.total`` on
        the client's test split, ``model@global.*`` on the global test set when there is one).

    Raises:
        UserInputError: the method deploys no global model (``global_model`` False), or its local
            training diverged (naming the client).
    """
    algo = fed.algorithm
    if not algo.global_model:
        raise UserInputError(f"{algo.name} deploys no global model, so it has no fine-tuned variant; allowed: "
                             "fedavg, fedprox, uniform, heterofl, fedrolex", field="--algorithms")
    out: dict[int, dict[str, float]] = {}
    for cid in range(len(fed.clients)) if clients is None else clients:
        ctx = client_context(fed, seed, cid, rnd)
        with naming_client(ctx):
            torch.manual_seed(ctx.init_seed)
            state = algo.init_client(ctx)  # a global-model method keeps no client state
            torch.manual_seed(ctx.seed)
            state, tuned = algo.client_update(state, algo.client_broadcast(broadcast, ctx.info), ctx)
            out[cid] = evaluate_state(fed, algo.prepare_evaluation(state, tuned, ctx), ctx)
    return out


__all__ = ["finetune_evaluate"]
