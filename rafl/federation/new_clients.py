"""The new-clients protocol: clients held out of training entirely, scored at the end on the final
federated model(s) of their device tier, as deployed and after one local fine-tune.

Most devices of a cross-device fleet never train (Kairouz et al., *Advances and Open Problems in
FL*, 2021, Sec. 1.1: a round samples a few hundred of millions of devices); what they get is the
federation's product. Held-out clients are the standard way to measure it (Yuan et al., *What Do We
Mean by Generalization in Federated Learning?*, ICLR 2022, Sec. 3: the "participation gap" between
participating and non-participating clients; pFedHN, Shamsian et al., ICML 2021, Sec. 5.3; FedRep,
Collins et al., ICML 2021, Sec. 5: new clients fine-tune the global representation).

A held-out client keeps everything a client has (its partition splits, its device profile, its
tier's subnet) but is never sampled: the engine's population is the other clients only, so the
participation rate applies to them. After the last round each held-out client deploys:

- a **global-model method** (``Algorithm.global_model``: uniform, heterofl, fedrolex, fedavg, ...):
  its tier's view of the final broadcast (``client_broadcast``: the global model or its slice);
- a **per-client method** (standalone, rafl, fedgh, fedtgp, fedproto, ...): the server holds no model
  of a tier, so the client gets the committed state of one *trained client of the same tier* (same
  ``model_key``: the one with the most training samples, ties to the lowest id) together with the
  final broadcast (global header, prototypes, knowledge network): what a new device of that tier can
  download in a deployment where a peer shares its trained model; a tier without a trained client
  falls back to the method's initial state (the tier's pretrained subnet) and says so (``donor``
  None). Standalone's row is then "a peer's local model", the comparison a new device faces.

Both are scored on the held-out client's own test split (its ``prepare_evaluation`` first: the
method's BN recalibration on the client's own train split, as for any client), and again after the
same short local fine-tune every ``-ft`` row gets (:mod:`rafl.federation.finetune`: one
``client_update`` of the method from that state with the final broadcast, the method's
``local_epochs``). Nothing of this reaches the server or is counted as communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from rafl import seeds
from rafl.federation.algorithms.base import ClientInfo
from rafl.federation.metric_keys import GLOBAL_SUFFIX, MODEL, TEST_SAMPLES, model_counts
from rafl.federation.payload import Payload
from rafl.federation.runners import Federation, client_context, evaluate_state, naming_client
from rafl.federation.store import ClientStore
from rafl.seeds import SeedTree


def held_out_clients(tiers: list[str], count: int, seed: int) -> list[int]:
    """Which ``count`` of the clients ``0..len(tiers)-1`` are held out, spread over the device tiers.

    Each tier's clients are shuffled (the seed tree's ``held-out`` leaf of ``seed``); the held-out
    clients are then taken one tier at a time in turn (tiers in sorted order), so the tiers lose
    clients in proportion, to within one. ``tiers``: each client's tier (device profile or model
    key). Returns the sorted client ids. Raises ``ValueError`` for ``count`` outside
    ``0..len(tiers) - 1`` (the config's check, :meth:`rafl.config.ClientsConfig.held_out_count`).
    """
    if not 0 <= count <= len(tiers) - 1:
        raise ValueError(f"can hold out 0..{len(tiers) - 1} of {len(tiers)} clients, not {count}")
    rng = seeds.generator("held-out", seed)
    queues = {t: list(rng.permutation([i for i, x in enumerate(tiers) if x == t])) for t in sorted(set(tiers))}
    picked: list[int] = []
    while len(picked) < count:
        for t in sorted(queues):
            if queues[t] and len(picked) < count:
                picked.append(int(queues[t].pop(0)))
    return sorted(picked)


def donors(clients: list[ClientInfo], trained: set[int]) -> dict[str, int]:
    """``model_key -> client id``: per tier, the trained client (in ``trained``) whose state a new client
    of that tier deploys under a per-client method: the most training samples, ties to the lowest id."""
    out: dict[str, int] = {}
    for info in clients:
        if info.client_id not in trained:
            continue
        best = out.get(info.model_key)
        if best is None or (info.n_samples, -info.client_id) > (clients[best].n_samples, -best):
            out[info.model_key] = info.client_id
    return out


def evaluate_new_clients(trained: Federation, store: ClientStore, new: Federation, seed: int, rounds: int,
                         broadcast: Payload, finetune: bool = True) -> dict[str, Any]:
    """Score every held-out client of ``new`` on the final federation of ``trained``.

    Args:
        trained: the federation that ran (its algorithm, its clients ``0..m-1``).
        store: its client store with the final committed states (per-client methods' donors).
        new: the held-out clients as a federation of their own (ids ``0..h-1``, same algorithm, data and
            supernet; no global test set needed).
        seed: the run seed; held-out client ``j`` draws from the seed tree as client ``m + j`` of round
            ``rounds + 1`` (a node no training client uses).
        rounds: the number of rounds that ran.
        broadcast: the final round's broadcast (the checkpoint's).
        finetune: also score after one local fine-tune.

    Returns:
        ``{"clients": {j: {"model.correct", "model.total", ..., "donor": id or None,
        "ft": {...counts} }}}`` in the evaluation contract (the deployed model's counts on the held-out
        client's test split).

    Raises:
        UserInputError: from the method (a diverged fine-tune), naming the held-out client.
    """
    algo = trained.algorithm
    tree = SeedTree(seed)
    given = {} if algo.global_model else donors(trained.clients, set(store.committed))
    out: dict[int, dict[str, Any]] = {}
    m = len(trained.clients)
    for j, info in enumerate(new.clients):
        ctx = dataclasses.replace(client_context(new, seed, j, rounds + 1), seed=tree.client(rounds + 1, m + j),
                                  init_seed=tree.client_init(m + j))
        donor = given.get(info.model_key)
        with naming_client(ctx):
            def start() -> Any:
                if donor is not None:
                    return store.load(donor)
                torch.manual_seed(ctx.init_seed)
                return algo.init_client(ctx)

            down = algo.client_broadcast(broadcast, ctx.info)
            rec: dict[str, Any] = dict(evaluate_state(new, algo.prepare_evaluation(start(), down, ctx), ctx))
            if finetune:
                torch.manual_seed(ctx.seed)
                state, tuned = algo.client_update(start(), down, ctx)
                # a global-model method keeps its model in the upload (as finetune_evaluate scores it); a
                # per-client method in its state, deployed with the final broadcast
                view = tuned if algo.global_model else down
                rec["ft"] = evaluate_state(new, algo.prepare_evaluation(state, view, ctx), ctx)
        rec["donor"] = donor
        out[j] = rec
    return {"clients": out}


def new_clients_summary(result: dict[str, Any], held_out: list[int], table: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``new_clients``: per held-out client (by its id in the whole population) its
    tier, donor and accuracies (``model.acc`` as deployed, ``model.acc_ft`` after the fine-tune), and
    their means over the held-out clients with a test split (``model.acc_mean``, ``model.acc_ft_mean``, and the
    same for a method's other accuracies, e.g. ``proto.acc_mean``).

    ``held_out``: the population ids of the held-out clients, in the order of ``new``'s clients;
    ``table``: their rows of the clients table (``profile``, ``n_train``, ``n_test``)."""
    clients: dict[str, dict[str, Any]] = {}
    mean_of: dict[str, str] = {}  # a client's accuracy key -> the key of its mean over the clients
    for j, rec in result["clients"].items():
        row = {"profile": table[j].get("profile", table[j].get("model")), "donor": rec.get("donor"),
               "n_train": table[j].get("n_train"), TEST_SAMPLES: rec.get(MODEL.total, 0)}
        for fine_tuned, counts in ((False, rec), (True, rec.get("ft") or {})):
            for m, correct, total in model_counts(counts):
                if GLOBAL_SUFFIX not in m.model:
                    key, mean_of_key = (m.acc_ft, m.acc_ft_mean) if fine_tuned else (m.acc, m.acc_mean)
                    row[key] = correct / total if total else None
                    mean_of[key] = mean_of_key
        clients[str(held_out[j])] = row
    means = {}
    for key in sorted(mean_of):
        vals = [r[key] for r in clients.values() if r.get(key) is not None]
        if vals:
            means[mean_of[key]] = float(np.mean(vals))  # model.acc_mean, model.acc_ft_mean, proto.acc_mean, ...
    return {"held_out": list(held_out), **means, "clients": clients}


__all__ = ["donors", "evaluate_new_clients", "held_out_clients", "new_clients_summary"]
