"""The node side of rafl's Flower backend: the ClientApp that runs a node message's client steps.

A SuperNode hands every ``train`` / ``evaluate`` message of a rafl run to :func:`_make_client_app`'s
ClientApp (exposed as :data:`rafl.federation.flower.client_app`). It rebuilds the run's
federation from the run config the message carries (cached per process), runs
:func:`~rafl.federation.engine.train_client` / :func:`~rafl.federation.engine.evaluate_client`
for each client of the message in order, with the seeds the in-process engine uses, and keeps the
clients' states in versioned files on the node's disk (:class:`ClientStore`). The message format
is described in :mod:`rafl.federation.flower`, whose server side sends them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rafl.errors import UserInputError
from rafl.federation.engine import Federation, client_context, evaluate_client, train_client
from rafl.federation.store import ClientStore
from rafl.io import load_yaml

_PREPARED: dict[str, Any] = {}


def _node_federation(config_text: str) -> tuple[Federation, int]:
    """The run's federation built on this node from the run config (cached per config)."""
    key = hashlib.sha256(config_text.encode()).hexdigest()
    if key not in _PREPARED:
        from rafl.config import RunConfig
        from rafl.federation import pipeline

        cfg = RunConfig.model_validate(load_yaml(config_text))
        _PREPARED.clear()  # one run at a time per ClientApp process
        _PREPARED[key] = (pipeline.prepare(cfg, progress=False).federation, cfg.seed)
    return _PREPARED[key]


def _state_root(node_config: dict[str, Any]) -> Path:
    root = node_config.get("state-dir") or os.environ.get("RAFL_FLOWER_STATE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "rafl" / "flower-states"


def _state_folder(ctl: Any, node_config: dict[str, Any]) -> Path:
    """This node's folder of the run's client states: the server's hint (the simulation's run
    dir ``clients/``, shared with the in-process engine) unless the node config names its own
    ``state-dir``; else ``<state root>/<run key>``."""
    hint = str(ctl.get("state_dir", "") or "")
    if hint and "state-dir" not in node_config:
        return Path(hint)
    return _state_root(node_config) / str(ctl["run_key"])


def _client_step(msg: Any, context: Any, kind: str, fed: Federation, seed: int, index: int) -> dict[str, Any]:
    """The ``index``-th client step a node message carries: its reply records."""
    from rafl.federation import flower as w  # the wire format (flower imports this module)

    ctl = msg.content.config_records[w.CONTROL]
    cid, rnd = int(ctl["client_ids"][index]), int(ctl["round"])
    version = int(ctl["state_versions"][index])
    pid, parts = int(context.node_config.get("partition-id", 0)), int(context.node_config.get("num-partitions", 1))
    if cid % max(1, parts) != pid:
        raise UserInputError(f"client {cid} is not hosted by this node (partition-id={pid}, num-partitions={parts})",
                             field="node_config")
    store = ClientStore(_state_folder(ctl, context.node_config), committed={cid: version} if version >= 0 else None)
    down = w.records_to_payload(msg.content, "the server", f".{int(ctl['slots'][index])}")
    ctx = client_context(fed, seed, cid, rnd)
    if kind == w.TRAIN:
        # A train message carries the version of the server's last checkpoint: the only one a
        # resumed run can need (an interrupted round's files go). Evaluation deletes nothing: the
        # server evaluates states it has not checkpointed yet.
        store.cleanup(cid)
        upload, _ = train_client(fed, store, ctx, down)
        return w.payload_to_records(upload, f".{cid}")
    app = w._flwr()
    return {f"metrics.{cid}": app.MetricRecord({k: float(v) for k, v in evaluate_client(fed, store, ctx, down).items()})}


def _node_handler(kind: str) -> Callable[[Any, Any], Any]:
    """A ClientApp function: every client step a message carries (:func:`_client_step`, in
    order) and one reply with all their records. A :class:`UserInputError` (bad input or
    diverged training: a fact about the run, not about the node) ends the message and goes back
    as a record, so the server stops with the same one-line error as in-process; any other
    exception of a client step loses that client only (``client_errors``, one line each)."""
    from rafl.federation import flower as w  # the wire format (flower imports this module)

    def handler(msg: Any, context: Any) -> Any:
        app = w._flwr()
        ctl = msg.content.config_records[w.CONTROL]
        records: dict[str, Any] = {}
        failed: dict[str, str] = {}
        cid = -1
        try:
            fed, seed = _node_federation(str(ctl["config"]))
            for index, cid in enumerate(int(c) for c in ctl["client_ids"]):
                try:
                    records.update(_client_step(msg, context, kind, fed, seed, index))
                except UserInputError:
                    raise
                except Exception as err:  # noqa: BLE001 - this client is lost, the node's others go on
                    failed[str(cid)] = w.one_line(f"{type(err).__name__}: {err}")
        except UserInputError as err:
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({
                "user_error": err.message, "user_error_source": err.source or "", "user_error_field": err.field or "",
                "user_error_client": cid if cid >= 0 else int(ctl["client_ids"][0])})}), reply_to=msg)
        return app.Message(app.RecordDict({**records, w.CONTROL: app.ConfigRecord({"client_errors": json.dumps(failed)})}),
                           reply_to=msg)
    return handler


def _integer(node_config: dict[str, Any], key: str, default: int) -> int:
    """The node config's ``key`` as an integer (:func:`rafl.federation.flower.whole_number`).

    Raises:
        ValueError: a value that is not a whole number, named with the key."""
    from rafl.federation.flower import whole_number

    value = node_config.get(key, default)
    number = whole_number(value)
    if number is None:
        raise ValueError(f"{key}={value!r} is not an integer")
    return number


def _make_client_app() -> Any:
    """rafl's ClientApp: the node-config / commit / discard queries and the two client steps."""
    from flwr.clientapp import ClientApp

    from rafl.federation import flower as w  # the wire format (flower imports this module)

    capp = ClientApp()

    @capp.query()
    def _query(msg: Any, context: Any) -> Any:
        app = w._flwr()
        nc = context.node_config
        ctl = msg.content.config_records[w.CONTROL]
        if ctl.get("ask") == "commit":  # the run ended: keep only the final version of each client
            folder = _state_folder(ctl, nc)
            for cid, version in json.loads(str(ctl["committed"])).items():
                ClientStore(folder, committed={int(cid): int(version)}).cleanup(int(cid))
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({"done": True})}), reply_to=msg)
        if ctl.get("ask") == "discard":  # the run failed before its first complete round
            folder = _state_folder(ctl, nc)
            if folder.name == str(ctl["run_key"]):  # never a folder the server named (a run dir's clients/)
                shutil.rmtree(folder, ignore_errors=True)
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({"done": True})}), reply_to=msg)
        try:
            answer = {"partition-id": _integer(nc, "partition-id", 0), "num-partitions": _integer(nc, "num-partitions", 1)}
        except ValueError as err:  # the server names this node and stops: its clients would stay unhosted
            answer = {"node_config_error": str(err)}
        return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord(answer)}), reply_to=msg)

    capp.train()(_node_handler(w.TRAIN))
    capp.evaluate()(_node_handler(w.EVALUATE))

    return capp
