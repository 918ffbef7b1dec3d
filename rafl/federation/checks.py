"""The checks a federated run passes before it starts or resumes: no leakage between the server's
public pool and the clients' data, the same data sample as the supernet trained on, and, on
``--resume``, the same rounds, clients and data as the run started with.

Used by ``rafl federate`` (:mod:`rafl.stages.prepare`), ``rafl compare`` and the Flower App.
Every check raises :class:`~rafl.errors.UserInputError` naming the field or file to change.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from rafl.config import RunConfig
from rafl.data import carve_public_pool
from rafl.errors import UserInputError
from rafl.io import safetensors_damage


# ---------------------------------------------------------------------- leakage
def check_disjoint(partition) -> None:
    """Assert the public pool and every client's train/val/test indices are pairwise disjoint.

    Raises:
        UserInputError: naming the two overlapping index sets and how many indices they share.
    """
    sets: list[tuple[str, np.ndarray]] = [("public pool", np.asarray(partition.public, dtype=np.int64))]
    for i, c in enumerate(partition.clients):
        for split in ("train", "val", "test"):
            sets.append((f"client {i} {split}", np.asarray(getattr(c, split), dtype=np.int64)))
    check_global_test(partition, sets[0][1])
    allidx = np.concatenate([s for _, s in sets]) if sets else np.zeros(0, np.int64)
    if len(np.unique(allidx)) == len(allidx):
        return
    owner: dict[int, str] = {}
    for name, s in sets:
        for v in s.tolist():
            if v in owner:
                raise UserInputError(f"index {v} is in both {owner[v]} and {name} (leakage)", field="partition")
            owner[v] = name


def check_global_test(partition, pool: np.ndarray | None = None) -> None:
    """Refuse a global test set (``partition.global_test``) that shares samples with any client's
    train/val/test split or with ``pool`` (the public pool the supernet trained on; default the
    partition's own).

    Raises:
        UserInputError: one line naming how many samples overlap and with what.
    """
    held = np.asarray(getattr(partition, "global_test", ()), dtype=np.int64)
    if not len(held):
        return
    pool = np.asarray(partition.public if pool is None else pool, dtype=np.int64)
    clients = [np.asarray(getattr(c, s), dtype=np.int64) for c in partition.clients for s in ("train", "val", "test")]
    in_clients = int(np.isin(held, np.concatenate(clients)).sum()) if clients else 0
    in_pool = int(np.isin(held, pool).sum())
    if in_clients or in_pool:
        raise UserInputError(f"the global test set overlaps client data in {in_clients} sample(s) and the supernet's "
                             f"public pool in {in_pool}; allowed: no overlap (leakage)",
                             field="partition.global_test_per_class")


def check_public_pool(algorithm, hparams: dict[str, Any], partition) -> None:
    """Raise UserInputError when ``algorithm`` (or its ``distill`` option) needs the server's
    public pool and ``partition`` carved none."""
    if algorithm.needs_public_pool(hparams) and len(partition.public) == 0:
        raise UserInputError(f"{algorithm.name} needs the server's public pool; set partition.public_fraction > 0",
                             field="partition.public_fraction")


def check_same_data(cfg: RunConfig, trained: dict[str, Any], what: str) -> None:
    """Refuse a run whose data sample differs from the one the supernet's public pool came from.

    Args:
        cfg: the run config.
        trained: the supernet's training config (``dataset``, ``limit_per_class``).
        what: the supernet as named in the message ("the quickstart supernet", a path).

    Raises:
        UserInputError: naming ``data.dataset`` or ``data.limit_per_class`` and the value the supernet
            trained on: the same pool fraction and seed would carve other images.
    """
    def yaml_value(v: Any) -> str:
        return "null" if v is None else str(v)

    for key, mine in (("dataset", cfg.data.dataset), ("limit_per_class", cfg.data.limit_per_class)):
        if key in trained and trained[key] != mine:
            raise UserInputError(
                f"{what} trained on {key}={yaml_value(trained[key])}, the run loads data.{key}="
                f"{yaml_value(mine)}: its public pool would be other images, and client data would overlap the "
                f"supernet's training data; set data.{key}={yaml_value(trained[key])} or train a supernet on "
                "this data", field=f"data.{key}")


def check_clients_avoid_pool(partition, labels: np.ndarray, pool: tuple[float, int], source: str,
                             origin: np.ndarray | None = None) -> None:
    """Refuse a partition whose clients hold images of the public pool the supernet trained on,
    ``carve_public_pool(labels, *pool)``: their test accuracy would be measured on training images.
    For a saved partition (``file:``), whose own pool need not be the config's ``public_fraction``.

    Raises:
        UserInputError: naming the file, how many client samples overlap and how to make a split
            that avoids the pool.
    """
    trained = carve_public_pool(labels, pool[0], pool[1], origin)
    held = np.concatenate([np.asarray(getattr(c, s), dtype=np.int64) for c in partition.clients
                           for s in ("train", "val", "test")] or [np.zeros(0, np.int64)])
    check_global_test(partition, trained)
    leaked = np.intersect1d(held, trained)
    if len(leaked):
        raise UserInputError(f"its clients hold {len(leaked)} samples (e.g. index {int(leaked[0])}) of the public pool "
                             f"the supernet trained on, carve_public_pool(labels, {pool[0]}, seed={pool[1]}), so "
                             "their accuracy would be measured on training images; allowed: a split whose clients "
                             f"avoid that pool (rafl data --public-fraction {pool[0]} --public-seed {pool[1]} ...)",
                             source=source, field="partition.scheme")


# ---------------------------------------------------------------------- resume
def completed_rounds(run_dir: str | Path) -> int:
    """Rounds ``run_dir`` completed: the rows of its ``metrics.jsonl`` (0 without one)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    return sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0


def check_resume_rounds(run_dir: str | Path, rounds: int, field: str) -> int:
    """The number of rounds ``run_dir`` completed (rows of ``metrics.jsonl``).

    Raises:
        UserInputError: ``rounds`` (the resumed run's ``engine.rounds``, set through ``field``)
            below that number."""
    done = completed_rounds(run_dir)
    if rounds < done:
        raise UserInputError(f"is {rounds} but the run has completed {done} rounds; allowed: an integer >= {done}",
                             field=field)
    return done


def check_checkpoint_readable(run_dir: str | Path, field: str = "--resume") -> None:
    """Refuse, before any work, to resume ``run_dir`` from a damaged ``checkpoint.safetensors``
    (cut short by a copy, a full disk, a sync tool; rafl itself replaces it atomically).

    Raises:
        UserInputError: naming the checkpoint, what is wrong (:func:`rafl.io.safetensors_damage`),
            the rounds ``metrics.jsonl`` records, and how to recover: restore the file from a
            copy, or start the run again from its ``config.yaml``. rafl keeps only the last
            round's checkpoint and deletes the client states of earlier rounds once it is
            written, so no earlier round can be resumed instead.
    """
    run_dir = Path(run_dir)
    path = run_dir / "checkpoint.safetensors"
    try:
        damage = safetensors_damage(path.read_bytes())
    except OSError as err:
        damage = f"cannot be read ({err.strerror})"
    if damage is None:
        return

    done = completed_rounds(run_dir)
    again = (f"rafl federate --config {shlex.quote(str(run_dir / 'config.yaml'))} --out "
             f"{shlex.quote(str(run_dir.parent))} --set name={shlex.quote(run_dir.name + '-2')}")
    raise UserInputError(f"is {damage}, so the run cannot continue from it (metrics.jsonl records {done} complete "
                         "round(s); rafl keeps only the last round's checkpoint, and the client states of earlier "
                         "rounds are deleted once it is written); restore checkpoint.safetensors from a copy, or "
                         f"start the run again: {again}", source=path, field=field)


#: the ``clients.json`` key of a run made by the Flower App on a SuperLink (``rafl flower-app``):
#: ``{"backend": "flower", "runtime": "superlink", "client_states": ...}``. Its client states
#: are on the SuperNodes' disks, not in the run dir's ``clients/``: only the App can resume it.
DEPLOYMENT = "deployment"


def deployment_of(run_dir: str | Path) -> dict[str, Any] | None:
    """The :data:`DEPLOYMENT` record of ``run_dir``'s ``clients.json``; None for a run made
    in-process or on the Simulation Runtime (or without a readable ``clients.json``)."""
    try:
        record = json.loads((Path(run_dir) / "clients.json").read_text()).get(DEPLOYMENT)
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def check_resumable_here(run_dir: str | Path, field: str = "--resume") -> None:
    """Refuse to resume in this process (in-process or on the Simulation Runtime) a run made by
    the Flower App on a SuperLink: its client states are on the SuperNodes' disks, so the first
    sampled client would stop the run with a missing state file.

    Raises:
        UserInputError: naming the ``flwr run`` command that resumes it."""
    if deployment_of(run_dir) is None:
        return
    where = Path(run_dir).resolve()
    raise UserInputError(f"ran on a SuperLink (rafl flower-app): its client states are on the SuperNodes' disks, not in "
                         f"the run dir; resume it with the Flower App: flwr run <app> <federation> --run-config "
                         f"\"resume='{where}'\"", source=run_dir, field=field)


#: the columns of a run's ``clients.json`` that a resumed run must reproduce (its data split and models)
SAME_CLIENT_KEYS = ("client", "n_train", "n_test", "model", "arch", "profile")


def check_same_clients(run_dir: str | Path, table: list[dict[str, Any]], partition: str = "") -> None:
    """Refuse to resume ``run_dir`` on other clients than it started with: the per-client table
    (:data:`SAME_CLIENT_KEYS`: training/test samples, model, profile) must equal the one its
    ``clients.json`` recorded. A partition file read from another folder, or edited, a changed
    dataset root or limit would otherwise continue the run silently on other data.

    Args:
        run_dir: a run dir (federate) or a method's folder (compare); no ``clients.json``: no check.
        table: the clients table the resumed run would use.
        partition: the config's ``partition.scheme``, named in the message.

    Raises:
        UserInputError: naming ``clients.json``, the first client that differs, and both values.
    """
    path = Path(run_dir) / "clients.json"
    try:
        recorded = json.loads(path.read_text())["clients"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    now = {int(r["client"]): r for r in table}
    before = {int(r["client"]): r for r in recorded if isinstance(r, dict) and "client" in r}
    cause = (f"the data or the partition changed ({partition or 'partition.scheme'}); resume with the data the run "
             "started with, or start a new run")
    if set(now) != set(before):
        raise UserInputError(f"records {len(before)} clients, the resumed run has {len(now)}: {cause}", source=path)
    for cid in sorted(now):
        diff = {k: (before[cid].get(k), now[cid].get(k)) for k in SAME_CLIENT_KEYS
                if k in before[cid] and k in now[cid] and before[cid][k] != now[cid][k]}
        if diff:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
            if not {"n_train", "n_test"} & set(diff):  # the same data, another model: a profile or the search changed
                cause = ("its model changed (a device profile, its budgets or the search gave another subnet); "
                         "resume with the profiles the run started with, or start a new run")
            raise UserInputError(f"client {cid} had other data or another model when the run started ({what}): {cause}",
                                 source=path)


__all__ = ["check_disjoint", "check_global_test", "check_public_pool", "check_same_data", "check_clients_avoid_pool", "completed_rounds",
           "check_resume_rounds", "SAME_CLIENT_KEYS", "check_same_clients", "DEPLOYMENT", "deployment_of",
           "check_resumable_here"]
