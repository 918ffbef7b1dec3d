"""The node side of rafl's Flower backend: the ClientApp that runs a node message's client steps.

A SuperNode hands every ``train`` / ``evaluate`` message of a rafl run to :func:`_make_client_app`'s
ClientApp (exposed as :data:`rafl.stages.flower.app.client_app`). It rebuilds the run's
federation from the run config the message carries (cached per process), runs
:func:`~rafl.federation.runners.train_client` / :func:`~rafl.federation.runners.evaluate_client`
for each client of the message in order, with the seeds the in-process engine uses, and keeps the
clients' states in versioned files on the node's disk (:class:`ClientStore`). The message format
is described in :mod:`rafl.federation.flower_wire`; :mod:`rafl.federation.flower_runner` sends them.

Trust boundary (:class:`NodeTrust`). A message comes from whoever can reach the SuperLink's
Fleet/Control API, so it may choose among what the node's operator allowed, never name anything
new: the plug-in models it may import (node config ``plugins``), the folders it may read run inputs
from (``data-roots``: dataset roots, supernet checkpoints, profile, arch and partition files) and
the folders it keeps client states in (``state-dir``, and ``shared-state-dirs`` for a state folder
the server names, as the Simulation Runtime does). Each key may also come from the node process's
environment (:data:`TRUST_ENV`); the node config wins. The Simulation Runtime's virtual nodes
(the user's own process) allow what the run config names (:func:`own_node_config`). A message naming anything else is refused
(:class:`Refused`, one line to the server naming the node-config key that would allow it), and
counted: one JSON line per refusal in ``<state-dir>/refused.jsonl`` and a line on the node's log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rafl.config import RunConfig
from rafl.errors import UserInputError
from rafl.federation import flower_wire as w
from rafl.federation.flower_wire import whole_number
from rafl.federation.runners import Federation, client_context, evaluate_client, train_client
from rafl.federation.store import ClientStore
from rafl.io import load_yaml
from rafl.models import is_plugin_spec, resolve_models
from rafl.search.profile import names_a_file
from rafl.stages.prepare import prepare

_PREPARED: dict[str, Any] = {}

#: the node-config keys of the trust boundary and the environment variables that stand in for
#: them when the node config does not set them (the node config wins)
TRUST_ENV = {"state-dir": "RAFL_FLOWER_STATE_DIR", "data-roots": "RAFL_FLOWER_DATA_ROOTS",
             "plugins": "RAFL_FLOWER_PLUGINS", "shared-state-dirs": "RAFL_FLOWER_SHARED_STATE_DIRS"}
#: a run key as :func:`rafl.stages.flower.app.run_key_of` makes it (the name of a run's state folder)
RUN_KEY = re.compile(r"[0-9a-f]{16}")
#: where a node counts the messages it refused (one JSON line each), under its state root
REFUSED_LOG = "refused.jsonl"


class Refused(UserInputError):
    """A message asked this node for something its own configuration does not allow (a plug-in
    module to import, a path to read, a state folder to write or delete); ``field`` names the
    node-config key that would allow it."""


def _node_setting(node_config: dict[str, Any], key: str) -> str:
    value = node_config.get(key)
    if value is None or value == "":
        value = os.environ.get(TRUST_ENV[key], "")
    return str(value)


def _within(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _arch_names_a_file(text: str) -> bool:
    """Whether a ``clients.arch`` / ``clients.archs`` value is read as a file (as the pipeline's
    ``_resolve_arch`` does), not parsed as an arch string."""
    path = Path(text).expanduser()
    return path.suffix in (".yaml", ".yml", ".json") or "/" in text or path.is_file()


def named_inputs(cfg: Any) -> tuple[list[tuple[str, Path]], list[str]]:
    """What a run config makes a node read or import: ``([(field, path), ...], [plug-in spec, ...])``
    -- ``data.root``, ``supernet.path``, a ``partition.scheme`` ``file:PATH``, profile files among
    ``clients.profiles``, arch files of ``clients.arch`` / ``clients.archs``, and the
    ``package.module:factory`` members of ``clients.models``. Null values (rafl's own default
    locations on the node) are not named."""
    paths: list[tuple[str, Path]] = []
    for field, value in (("data.root", cfg.data.root), ("supernet.path", cfg.supernet.path)):
        if value:
            paths.append((field, Path(value)))
    if cfg.partition.scheme.startswith("file:"):
        paths.append(("partition.scheme", Path(cfg.partition.scheme[len("file:"):])))
    paths += [("clients.profiles", Path(v)) for v in cfg.clients.profiles if names_a_file(v)]
    if cfg.clients.arch is not None and _arch_names_a_file(cfg.clients.arch):
        paths.append(("clients.arch", Path(cfg.clients.arch)))
    paths += [(f"clients.archs.{k}", Path(v)) for k, v in sorted(cfg.clients.archs.items()) if _arch_names_a_file(v)]
    plugins = [] if cfg.clients.models.strip().lower() == "nas" else [
        m for m in resolve_models(cfg.clients.models) if is_plugin_spec(m)]
    return [(f, p.expanduser()) for f, p in paths], sorted(set(plugins))


@dataclasses.dataclass(frozen=True)
class NodeTrust:
    """What this node's operator allows a message to use (node config, else :data:`TRUST_ENV`).

    Attributes:
        state_root: ``state-dir``; a run's client states go to ``<state_root>/<run key>``
            (default ``~/.cache/rafl/flower-states``).
        data_roots: ``data-roots`` (folders separated by ``os.pathsep``): every file or folder a
            run config names (:func:`named_inputs`) must lie in one, after resolving symlinks.
        plugins: ``plugins`` (comma-separated ``package.module:factory``): the plug-in models a
            run config may name.
        shared_state_dirs: ``shared-state-dirs`` (``os.pathsep``-separated): exact folders a
            message may name as a run's state folder (the Simulation Runtime's run dir
            ``clients/``); none on a SuperNode by default.
    """

    state_root: Path
    data_roots: tuple[Path, ...]
    plugins: frozenset[str]
    shared_state_dirs: tuple[Path, ...]

    @classmethod
    def of(cls, node_config: dict[str, Any]) -> NodeTrust:
        def folders(key: str) -> tuple[Path, ...]:
            return tuple(Path(p).expanduser().resolve() for p in _node_setting(node_config, key).split(os.pathsep)
                         if p.strip())

        root = _node_setting(node_config, "state-dir")
        return cls(state_root=Path(root).expanduser() if root else Path.home() / ".cache" / "rafl" / "flower-states",
                   data_roots=folders("data-roots"), shared_state_dirs=folders("shared-state-dirs"),
                   plugins=frozenset(p.strip() for p in _node_setting(node_config, "plugins").split(",") if p.strip()))

    def check_run_config(self, cfg: Any) -> None:
        """Refuse a run config that names a path outside :attr:`data_roots` or a plug-in not in
        :attr:`plugins` (before anything is read or imported).

        Raises:
            Refused: naming the run-config field, the value and the node-config key to change."""
        paths, plugins = named_inputs(cfg)
        for field, path in paths:
            if not _within(path.resolve(), self.data_roots):
                roots = os.pathsep.join(str(r) for r in self.data_roots) or "none"
                raise Refused(f"the message's {field} names {str(path)!r}, outside this node's data-roots ({roots}); "
                              "a message may only choose among the node's own inputs: allow its folder with "
                              f"--node-config \"data-roots='FOLDER{os.pathsep}...'\" on the SuperNode",
                              field="node_config.data-roots")
        for spec in plugins:
            if spec not in self.plugins:
                allowed = ",".join(sorted(self.plugins)) or "none"
                raise Refused(f"the message's clients.models names plug-in {spec!r}, which this node does not allow "
                              f"(plugins: {allowed}); a message may only choose among the node's own plug-ins: allow "
                              f"it with --node-config \"plugins='{spec}'\" on the SuperNode", field="node_config.plugins")

    def run_folder(self, ctl: Any) -> Path:
        """The message's run's client-state folder: ``<state_root>/<run key>``, or the folder the
        message names when it is one of :attr:`shared_state_dirs`.

        Raises:
            Refused: a run key that is not rafl's (16 hex digits: no path of its own), or a named
                folder that is not a shared state dir."""
        key = str(ctl.get("run_key", ""))
        if not RUN_KEY.fullmatch(key):
            raise Refused(f"the message's run_key is {key[:60]!r}; allowed: 16 hex digits (rafl's run key names a "
                          "folder in the node's state-dir, never a path)", field="node_config.state-dir")
        named = str(ctl.get("state_dir", "") or "")
        if not named:
            return self.state_root / key
        folder = Path(named).expanduser().resolve()
        if folder not in self.shared_state_dirs:
            shared = os.pathsep.join(str(d) for d in self.shared_state_dirs) or "none"
            raise Refused(f"the message names state folder {named[:200]!r}, which is not one of this node's "
                          f"shared-state-dirs ({shared}); a node keeps client states in <state-dir>/<run key> "
                          "unless its operator shares a folder with --node-config \"shared-state-dirs='FOLDER'\"",
                          field="node_config.shared-state-dirs")
        return folder

    def count_refusal(self, err: Refused, msg: Any) -> int:
        """Count ``err`` (refusing ``msg``): a JSON line in ``<state_root>/refused.jsonl`` and a
        line on stderr (the SuperNode's log). Returns the number of refusals counted so far (0 when
        the log cannot be written)."""
        log = self.state_root / REFUSED_LOG
        meta = getattr(msg, "metadata", None)
        row = {"time": time.time(), "run_id": getattr(meta, "run_id", None),
               "message_type": getattr(meta, "message_type", None), "field": err.field, "reason": err.message}
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            count = sum(1 for _ in log.open())
        except OSError:
            count = 0
        print(f"rafl node: refused a message ({row['message_type']}) of run {row['run_id']}: {err} "
              f"({count} refused so far, {log})", file=sys.stderr, flush=True)
        return count


def own_node_config(cfg: Any, state_folder: str | Path) -> dict[str, str]:
    """The trust settings (node-config keys) of a node that is the user's own process: the
    Simulation Runtime's virtual SuperNodes run the user's run config on the user's machine, so
    they allow exactly what it names (:func:`named_inputs`) and the run dir's ``state_folder``
    (handed to :func:`_make_client_app`, which travels to the Ray workers with the ClientApp)."""
    paths, plugins = named_inputs(cfg)
    return {"data-roots": os.pathsep.join(sorted({str(p.resolve()) for _, p in paths})),
            "plugins": ",".join(plugins), "shared-state-dirs": str(Path(state_folder).resolve())}


def refusals(state_root: str | Path) -> list[dict[str, Any]]:
    """The refusals a node counted under ``state_root`` (:meth:`NodeTrust.count_refusal`), oldest first."""
    log = Path(state_root) / REFUSED_LOG
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


#: called with a run config text the first time this process meets it, after the node's trust
#: rules accepted it and before the federation is built: rafl's forking SuperExec
#: (:mod:`rafl.stages.flower.superexec`) sets it in its children, to build the run once in the
#: warm process the next children fork from; None otherwise
on_new_run: Callable[[str], None] | None = None


def _parse_run_config(config_text: str) -> Any:
    """The message's run config (a :class:`~rafl.config.RunConfig`).

    Raises:
        UserInputError: a run config that is not YAML or not valid (field ``config``)."""
    try:
        return RunConfig.model_validate(load_yaml(config_text))
    except yaml.YAMLError as err:
        raise UserInputError(f"the message's run config is not YAML ({w.one_line(str(err))})", field="config") from None
    except ValidationError as err:
        raise UserInputError(f"the message's run config is invalid ({err.errors()[0].get('msg', 'invalid')})",
                             field="config") from None


def config_key(config_text: str) -> str:
    """The cache key of a run config text (its SHA-256, hex)."""
    return hashlib.sha256(config_text.encode()).hexdigest()


def _build(config_text: str, cfg: Any) -> tuple[Federation, int]:
    """The run's federation, from the cache or built (``rafl.stages.prepare.prepare``) and cached: one run at
    a time per process."""
    key = config_key(config_text)
    if key not in _PREPARED:
        _PREPARED.clear()
        _PREPARED[key] = (prepare(cfg, progress=False).federation, cfg.seed)
    return _PREPARED[key]


def _accept(config_text: str, trust: NodeTrust) -> tuple[Any, bool]:
    """``(run config, reported)``: the message's run config after
    :meth:`NodeTrust.check_run_config`, reported to :data:`on_new_run` (this ClientApp's SuperExec,
    which builds it for later messages) when it is new here and one torch thread (see :func:`warm`).

    Raises:
        Refused: the config names an input the node does not allow.
        UserInputError: a run config that is not YAML or not valid."""
    cfg = _parse_run_config(config_text)
    trust.check_run_config(cfg)  # every message: the cache is no way around the node's rules
    report = on_new_run is not None and config_key(config_text) not in _PREPARED and cfg.train.threads == 1
    if report:
        on_new_run(config_text)
    return cfg, report


def _node_federation(config_text: str, trust: NodeTrust) -> tuple[Federation, int]:
    """The run's federation built on this node from the run config (cached per config), after
    :func:`_accept`.

    Raises:
        Refused: the config names an input the node does not allow.
        UserInputError: an invalid run config."""
    return _build(config_text, _accept(config_text, trust)[0])


def warm(config_text: str) -> None:
    """Build and cache the federation of a run config that a forked ClientApp child of this
    process accepted under the node's trust rules (:data:`on_new_run`), so that the next children
    start with it. The text is the message's own, already checked by the child against the node
    config it came with; this builds it with the same code the child runs.

    A run with ``train.threads`` other than 1 is not built here (its children build it): building
    would start torch's thread pool in this process, and a child forked from a process with a
    running pool hangs at its first parallel operation (GNU OpenMP is not fork-safe).

    Raises:
        UserInputError: an invalid run config; whatever ``rafl.stages.prepare.prepare`` raises."""
    cfg = _parse_run_config(config_text)
    if cfg.train.threads == 1:
        _build(config_text, cfg)


def _warm(config_text: str, node_config: dict[str, Any]) -> dict[str, Any]:
    """A ``warm`` query's answer: ``{"warming": True}`` when :func:`_accept` reported the run config
    to this ClientApp's SuperExec for it to build; else ``{"warming": False}`` (no SuperExec of
    rafl's, built already, several torch threads). A config the node refuses or cannot read is
    answered ``warming: False`` and not counted as a refusal: the run's first train message is
    refused and reported as always."""
    try:
        return {"warming": _accept(config_text, NodeTrust.of(node_config))[1]}
    except UserInputError:
        return {"warming": False}


def _client_step(msg: Any, node_config: dict[str, Any], kind: str, fed: Federation, seed: int,
                 index: int) -> dict[str, Any]:
    """The ``index``-th client step a node message carries: its reply records."""
    ctl = msg.content.config_records[w.CONTROL]
    cid, rnd = int(ctl["client_ids"][index]), int(ctl["round"])
    version = int(ctl["state_versions"][index])
    pid, parts = int(node_config.get("partition-id", 0)), int(node_config.get("num-partitions", 1))
    if cid % max(1, parts) != pid:
        raise UserInputError(f"client {cid} is not hosted by this node (partition-id={pid}, num-partitions={parts})",
                             field="node_config")
    store = ClientStore(NodeTrust.of(node_config).run_folder(ctl),
                        committed={cid: version} if version >= 0 else None)
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


#: the node's clock for its per-client deadlines (seconds)
_clock = time.monotonic
#: the share of the message's ``deadline_s`` (the server's round timeout) a node spends on its
#: clients: the rest covers the ClientApp's start and the reply's transfer, which it cannot time
BUDGET_SHARE = 0.9


def _node_handler(kind: str, own: dict[str, str] | None = None) -> Callable[[Any, Any], Any]:
    """A ClientApp function: every client step a message carries (:func:`_client_step`, in
    order) and one reply with all their records. A :class:`UserInputError` of a client step
    (diverged training, a state that does not fit) fails that client only and goes back as a
    record (``client_user_errors``: message, source, field), which the server treats as in-process:
    that client is left out of the round, and the run stops with the error only when too few
    clients remain; any other exception of a client step loses that client only (``client_errors``,
    one line each). A node that refuses the message (:class:`Refused`) or cannot build the run's
    federation replies with one ``user_error`` record for the whole message.

    Per-client deadline: the message's ``deadline_s`` is the server's round timeout. Before each
    client after the first, a node whose elapsed time plus its mean step time so far would pass
    :data:`BUDGET_SHARE` of it starts no more clients and replies with those done; the rest are
    lost for the round (named with the reason), not the whole batch."""
    def handler(msg: Any, context: Any) -> Any:
        app = w._flwr()
        ctl = msg.content.config_records[w.CONTROL]
        records: dict[str, Any] = {}
        failed: dict[str, str] = {}
        client_errors: dict[str, dict[str, str]] = {}
        cid = -1
        node_config = {**(own or {}), **context.node_config}
        trust = NodeTrust.of(node_config)
        start = _clock()
        budget = BUDGET_SHARE * float(ctl.get("deadline_s", 0.0) or 0.0)  # 0: none (an older server)
        try:
            trust.run_folder(ctl)  # before anything is built or written
            fed, seed = _node_federation(str(ctl["config"]), trust)
            steps: list[float] = []
            for index, cid in enumerate(int(c) for c in ctl["client_ids"]):
                spent = _clock() - start
                if budget > 0 and steps and spent + sum(steps) / len(steps) > budget:
                    # the next step would likely end after the server stopped waiting: reply now with
                    # the clients done (they count), instead of losing the whole batch to the timeout
                    failed[str(cid)] = (f"not started: this node's earlier clients took {spent:.1f} s of the "
                                        f"{ctl['deadline_s']:g} s round timeout (engine.round_timeout_s)")
                    continue
                t0 = _clock()
                try:
                    records.update(_client_step(msg, node_config, kind, fed, seed, index))
                except Refused:
                    raise
                except UserInputError as err:  # this client's error (e.g. diverged training); the others go on
                    client_errors[str(cid)] = {"message": w.one_line(err.message), "source": err.source or "",
                                               "field": err.field or ""}
                except Exception as err:  # noqa: BLE001 - this client is lost, the node's others go on
                    failed[str(cid)] = w.one_line(f"{type(err).__name__}: {err}")
                steps.append(_clock() - t0)
        except UserInputError as err:
            if isinstance(err, Refused):
                trust.count_refusal(err, msg)
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({
                "refused": isinstance(err, Refused), "user_error": err.message, "user_error_source": err.source or "",
                "user_error_field": err.field or "",
                "user_error_client": cid if cid >= 0 else int(ctl["client_ids"][0])})}), reply_to=msg)
        return app.Message(app.RecordDict({**records, w.CONTROL: app.ConfigRecord({
            "client_errors": json.dumps(failed), "client_user_errors": json.dumps(client_errors)})}), reply_to=msg)
    return handler


def _integer(node_config: dict[str, Any], key: str, default: int) -> int:
    """The node config's ``key`` as an integer (:func:`rafl.federation.flower_wire.whole_number`).

    Raises:
        ValueError: a value that is not a whole number, named with the key."""
    value = node_config.get(key, default)
    number = whole_number(value)
    if number is None:
        raise ValueError(f"{key}={value!r} is not an integer")
    return number


def _make_client_app(own: dict[str, str] | None = None) -> Any:
    """rafl's ClientApp: the node-config / warm / ready / commit / discard queries and the two client steps.
    ``own``: trust settings (node-config keys) under the node config's own, for nodes that are
    the user's own process (:func:`own_node_config`); None on a SuperNode."""
    from flwr.clientapp import ClientApp  # noqa: PLC0415 - flwr: optional (rafl[flower])

    capp = ClientApp()

    @capp.query()
    def _query(msg: Any, context: Any) -> Any:
        app = w._flwr()
        nc = {**(own or {}), **context.node_config}
        ctl = msg.content.config_records[w.CONTROL]
        if ctl.get("ask") in ("commit", "discard"):
            trust = NodeTrust.of(nc)
            try:
                folder = trust.run_folder(ctl)
                if ctl.get("ask") == "commit":  # the run ended: keep only the final version of each client
                    for cid, version in json.loads(str(ctl["committed"])).items():
                        ClientStore(folder, committed={int(cid): int(version)}).cleanup(int(cid))
                else:  # the run failed before its first complete round: its folder in this node's state-dir
                    if str(ctl.get("state_dir", "") or ""):
                        raise Refused("a discard message names a state folder; a node deletes only "
                                      "<state-dir>/<run key> of its own state-dir", field="node_config.state-dir")
                    shutil.rmtree(folder, ignore_errors=True)
            except Refused as err:
                trust.count_refusal(err, msg)
                return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({"refused": str(err)})}), reply_to=msg)
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({"done": True})}), reply_to=msg)
        if ctl.get("ask") == "warm":  # build the run before round 1 (rafl.federation.flower_runner.warm_nodes)
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord(_warm(str(ctl["config"]), nc))}),
                               reply_to=msg)
        if ctl.get("ask") == "ready":  # started after the SuperExec built the reported run: it is ready
            return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord({"done": True})}), reply_to=msg)
        try:
            answer = {"partition-id": _integer(nc, "partition-id", 0), "num-partitions": _integer(nc, "num-partitions", 1)}
        except ValueError as err:  # the server names this node and stops: its clients would stay unhosted
            answer = {"node_config_error": str(err)}
        return app.Message(app.RecordDict({w.CONTROL: app.ConfigRecord(answer)}), reply_to=msg)

    capp.train()(_node_handler(w.TRAIN, own))
    capp.evaluate()(_node_handler(w.EVALUATE, own))

    return capp
