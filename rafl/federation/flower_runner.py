"""The Flower client runner: the same engine, with the client steps run as Flower ClientApps on SuperNodes.

rafl's :class:`~rafl.federation.engine.Engine` keeps everything that is not a client's own
computation -- sampling, sporadic participation, dropout, communication counting, evaluation
summaries, metrics, checkpoints and ``--resume`` -- and hands the client steps to a *runner*.
:class:`FlowerClients` is that runner for Flower (``flwr`` 1.42, the Message API): each round it
sends one ``train`` :class:`flwr.app.Message` to every SuperNode hosting sampled clients, carrying
the steps of all of them, and waits for the replies; evaluation sends ``evaluate`` messages the
same way. One message per node, not per client: a deployed SuperNode starts a ClientApp process
per message, which imports torch and rebuilds the federation. The ClientApp
(:data:`rafl.stages.flower.app.client_app`) runs :func:`~rafl.federation.runners.train_client` /
:func:`~rafl.federation.runners.evaluate_client`, the very functions the in-process runner calls,
with the same seeds, so both backends compute the same numbers.

Why not a ``flwr.serverapp.strategy.Strategy`` and its ``start()`` loop: that loop always begins at
round 1 and carries one ``ArrayRecord`` between rounds, so it cannot resume from rafl's checkpoint,
cannot give each client its own broadcast (FedGH/FedTGP send per-client views, LG-FedAvg its
global part) and would duplicate the engine's accounting. The ServerApp here drives Flower's
:class:`~flwr.serverapp.Grid` directly, which is Flower's documented low-level API.

What travels: :mod:`rafl.federation.flower_wire`. Communication is counted by the engine from
:meth:`Payload.nbytes`, identical for both backends; Flower's own framing is not counted.

Clients and nodes: the server asks every connected node for its ``node_config``. A node with
``partition-id = i`` and ``num-partitions = P`` hosts the clients ``i, i + P, i + 2P, ...`` of the
run's population (with ``P`` = number of clients, one client per node as in Flower's examples).
Every node builds the run's federation itself from the run config (same data, partition, supernet
and search cache), and keeps its clients' states on its own disk under ``state-dir`` (node
config; default ``~/.cache/rafl/flower-states``) in versioned files (:class:`ClientStore`), so a
resumed run repeats an interrupted round from the committed versions.

Failures. A client step that raises a :class:`UserInputError` on its node (diverged training, a
missing state file), or a node that refuses the message, is that client's failure, as in-process:
it is left out of the round with its reason (``rejected_reasons``, naming the node), and the run
stops with that error only when fewer than ``engine.min_valid_uploads`` valid uploads of the
round remain (a learning rate too large for every client). A node that replies with any other error, or not within
``engine.round_timeout_s``, loses its clients for that round: they count as failed (the metrics
row names them under ``lost``, or ``eval_lost`` for evaluation, with a one-line reason) and the
round completes with the rest, as with simulated dropout; a round with every client lost stops
the run. On the Simulation Runtime any loss is an error (virtual nodes do not drop out). Only
training messages delete superseded state versions (and one message after the final
checkpoint): the server evaluates states it has not checkpointed yet. A run that fails before its
first checkpoint asks the nodes to delete its state folder (:meth:`FlowerClients.discard`).

The node side (the ClientApp that runs a message's client steps) is :mod:`rafl.stages.flower.node`;
the Flower App, the Simulation Runtime entry point and the local fleet are the other modules of
:mod:`rafl.stages.flower`, which hand this runner to the engine.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from rafl.errors import UserInputError, warn
from rafl.federation.engine import Federation
from rafl.federation.flower_wire import (
    CONTROL,
    EVALUATE,
    QUERY,
    TRAIN,
    _blob_records,
    _blob_size,
    _flwr,
    one_line,
    records_to_payload,
)
from rafl.federation.payload import Payload
from rafl.federation.runners import ClientRunner
from rafl.federation.screening import ClientError, RejectedUpload
from rafl.federation.store import ClientStore

# ---------------------------------------------------------------------- server side
#: seconds between the server's requests for the replies still missing: each is a request the
#: SuperLink serves, and on a machine that also runs the clients a shorter wait takes their CPU
#: (bench/flower_overhead.py: 0.05 s cost the SuperLink 2.5x the CPU of 0.2 s, for slower rounds)
REPLY_POLL_S = 0.2


class Stopped(Exception):
    """The run was interrupted (Ctrl-C / SIGTERM in the caller) while waiting for nodes: the
    round in progress is abandoned, nothing more is committed."""


def _exchange(grid: Any, messages: list[tuple[Any, Any]], timeout: float,
              stop: threading.Event | None = None) -> tuple[dict[Any, Any], dict[Any, str]]:
    """Push ``(key, Message)`` pairs and pull the replies until every one arrived or ``timeout``
    seconds passed. Returns ``(replies by key, reasons by key)`` for replies and for failures
    (an error reply, reason on one line; or no reply in time).

    Raises:
        Stopped: ``stop`` was set while waiting."""
    keys = [k for k, _ in messages]
    ids = list(grid.push_messages([m for _, m in messages]))
    key_of = dict(zip(ids, keys))
    replies: dict[Any, Any] = {}
    lost: dict[Any, str] = {}
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise Stopped("interrupted while waiting for the nodes' replies")
        for reply in grid.pull_messages(list(pending)):
            mid = reply.metadata.reply_to_message_id
            if mid not in pending:
                continue
            pending.discard(mid)
            if reply.has_error():
                lost[key_of[mid]] = f"node error: {one_line(reply.error.reason)}"
            else:
                replies[key_of[mid]] = reply
        if pending:
            time.sleep(REPLY_POLL_S)
    for mid in pending:
        lost[key_of[mid]] = f"no reply within {timeout:g} s"
    return replies, lost


def _json_object(rec: Any, key: str) -> dict[str, Any]:
    """The JSON object a node's control record holds under ``key`` ({} when absent or not an object)."""
    if rec is None or key not in rec:
        return {}
    try:
        value = json.loads(str(rec[key]))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class NodeMap(dict):
    """``client id -> node id`` (a plain dict), remembering each node's ``partition-id`` so errors
    name a node as its operator knows it (Flower's node ids are random 64-bit numbers)."""

    def __init__(self, node_of: dict[int, int], partitions: dict[int, tuple[int, int]]):
        super().__init__(node_of)
        self.partitions = dict(partitions)  # node id -> (partition-id, num-partitions)

    def name(self, cid: int) -> str:
        """``"node 8213... (partition-id=1)"`` for the node hosting client ``cid``."""
        nid = self[cid]
        return f"node {nid} (partition-id={self.partitions[nid][0]})" if nid in self.partitions else f"node {nid}"


def node_name(node_of: dict[int, int], cid: int) -> str:
    """How errors name the node hosting client ``cid`` (with its partition-id when known)."""
    return node_of.name(cid) if isinstance(node_of, NodeMap) else f"node {node_of[cid]}"


def partition_of(rec: Any, nid: int) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from node ``nid``'s answer to the node-config query.

    Raises:
        UserInputError: a node config that is not integers, or a partition-id outside
            0..num-partitions-1 (node 1 of ``partition-id=3 num-partitions=2`` used to host clients
            3, 5, ... of the server's list, and the run to fail naming only the clients it missed)."""
    fix = "restart it with --node-config \"partition-id=I num-partitions=P\", I in 0..P-1"
    if "node_config_error" in rec:
        raise UserInputError(f"node {nid}: {rec['node_config_error']}; {fix}", field="node_config")
    pid, parts = int(rec["partition-id"]), int(rec["num-partitions"])
    if parts < 1:
        raise UserInputError(f"node {nid} has num-partitions={parts}; allowed: an integer >= 1; {fix}",
                             field="node_config.num-partitions")
    if not 0 <= pid < parts:
        raise UserInputError(f"node {nid} has partition-id={pid} with num-partitions={parts}; allowed: 0..{parts - 1}; "
                             f"{fix}", field="node_config.partition-id")
    return pid, parts


def discover_nodes(grid: Any, n_clients: int, timeout: float, *, simulation: bool = False,
                   stop: threading.Event | None = None) -> dict[int, int]:
    """Map every client id of the population to the node that hosts it (a :class:`NodeMap`).

    Waits up to ``timeout`` seconds for nodes to connect and answer the query.

    Raises:
        UserInputError: a client id no node hosts (naming the node configs seen and the allowed
            values), or two nodes claiming the same client.
    """
    app = _flwr()
    deadline = time.monotonic() + timeout
    seen: dict[int, tuple[int, int]] = {}
    asked: dict[str, int] = {}  # message id -> node: one query per node at a time
    while True:
        # Each node is asked once and its reply awaited while others answer: a node that left
        # (listed until its heartbeat expires) must not hold up a population the others cover,
        # and a node that starts a ClientApp process per message must not be asked again and again.
        new = [nid for nid in sorted(grid.get_node_ids()) if nid not in seen and nid not in asked.values()]
        if new:
            msgs = [app.Message(app.RecordDict({CONTROL: app.ConfigRecord({"ask": "node_config"})}),
                                dst_node_id=nid, message_type=QUERY) for nid in new]
            asked.update(zip(grid.push_messages(msgs), new))
        for reply in grid.pull_messages(list(asked)) if asked else []:
            nid = asked.pop(reply.metadata.reply_to_message_id, None)
            if nid is not None and not reply.has_error():  # a node that failed is asked again
                seen[nid] = partition_of(reply.content.config_records[CONTROL], nid)  # a bad node config: at once
                if seen[nid][0] >= n_clients:
                    warn(f"node {nid} (partition-id={seen[nid][0]} num-partitions={seen[nid][1]}) hosts none of the "
                         f"run's {n_clients} clients: with num-partitions > {n_clients}, partition-ids "
                         f"{n_clients}..{seen[nid][1] - 1} stay idle")
        node_of: dict[int, int] = {}
        for nid, (pid, parts) in sorted(seen.items()):
            for cid in range(pid, n_clients, max(1, parts)):
                if cid in node_of:
                    raise UserInputError(f"nodes {node_of[cid]} and {nid} both host client {cid}: give every "
                                         "SuperNode its own partition-id in 0..num-partitions-1",
                                         field="node_config.partition-id")
                node_of[cid] = nid
        missing = [c for c in range(n_clients) if c not in node_of]
        if not missing:
            return NodeMap(node_of, seen)
        if time.monotonic() >= deadline:
            got = ", ".join(f"node {nid}: partition-id={p} num-partitions={q}" for nid, (p, q) in sorted(seen.items()))
            if simulation:
                raise UserInputError(f"the Simulation Runtime's virtual SuperNodes did not answer within {timeout:g} s "
                                     f"({got or 'none answered'}); see the Ray log above", field="engine.backend")
            raise UserInputError(
                f"no connected SuperNode hosts client(s) {missing[:10]}{'...' if len(missing) > 10 else ''} of the "
                f"{n_clients} clients after {timeout:g} s ({got or 'no node answered'}); start SuperNodes with "
                f"--node-config \"partition-id=I num-partitions=P\" for I in 0..P-1, P <= {n_clients}",
                field="node_config")
        if stop is not None and stop.is_set():
            raise Stopped("interrupted while waiting for SuperNodes")
        time.sleep(0.2)


def warm_nodes(grid: Any, node_ids: list[int], config_text: str, timeout: float,
               stop: threading.Event | None = None) -> list[int]:
    """Have every node build the run's federation before round 1, as ``rafl federate`` prepares
    its own before its first round.

    A ``warm`` query carries the run config to each node in ``node_ids``. A node whose ClientApps
    are forked by ``rafl flower-superexec`` checks it against its own trust rules (as a train
    message's would be), reports it to the SuperExec and answers ``warming``; the SuperExec
    builds the federation before it starts the next ClientApp
    (:class:`rafl.stages.flower.superexec.ForkExecutor`). A ``ready`` query to those nodes is that
    next ClientApp, so its reply arrives once the node is built. Without this, round 1's first
    message built the federation twice on each node (the ClientApp for itself, the SuperExec
    for later messages) while it trained. A node that does not build (Flower's own SuperExec,
    an older rafl, a refused config) answers without ``warming`` and is not waited for: its
    first message builds what it needs, and a refusal is reported there, as before.

    Returns:
        the node ids that confirmed they are built (best effort: a lost reply only costs time).
    Raises:
        Stopped: ``stop`` was set while waiting."""
    app = _flwr()

    def ask(nodes: list[int], what: dict[str, Any]) -> dict[Any, Any]:
        msgs = [(nid, app.Message(app.RecordDict({CONTROL: app.ConfigRecord(what)}), dst_node_id=nid,
                                  message_type=QUERY)) for nid in nodes]
        return _exchange(grid, msgs, timeout, stop)[0]

    warming = [nid for nid, reply in ask(sorted(node_ids), {"ask": "warm", "config": config_text}).items()
               if reply.content.config_records.get(CONTROL, {}).get("warming")]
    return sorted(ask(warming, {"ask": "ready"})) if warming else []


#: the most upload bytes one train message's reply may carry: a node with more sampled clients
#: than fit gets several messages (:meth:`FlowerClients._batches`), so a node's reply, and the
#: memory that holds it on the node and the SuperLink, stay bounded
MAX_REPLY_BYTES = 256 * 2**20


class FlowerClients(ClientRunner):
    """The engine's client runner over a Flower :class:`~flwr.serverapp.Grid`.

    Args:
        fed: the federation (server side; used for client infos only).
        store: the engine's :class:`ClientStore`; only its committed/pending version maps are
            used here (the files live on the nodes).
        seed: the run seed (travels implicitly: nodes rebuild it from ``config_text``).
        grid: the ServerApp's grid.
        node_of: ``client id -> node id`` (:func:`discover_nodes`).
        config_text: the resolved run config as YAML.
        run_key: names this run's state folder on the nodes.
        timeout: seconds to wait for a round's replies.
        state_dir: where the nodes keep client states when they share this machine's disk (the
            Simulation Runtime: the run dir's ``clients/``, as in-process, so a run can resume
            on either backend); "" = each node's own ``state-dir``.
        stop: set by the caller to abandon the round in progress (:class:`Stopped`).
        simulation: Flower's Simulation Runtime: a lost client is an error there (virtual nodes
            do not drop out; one fails only when the run is broken or interrupted).
    """

    def __init__(self, fed: Federation, store: ClientStore, seed: int, *, grid: Any, node_of: dict[int, int],
                 config_text: str, run_key: str, timeout: float, state_dir: str = "",
                 stop: threading.Event | None = None, simulation: bool = False):
        self.fed, self.store, self.seed = fed, store, seed
        self.state_dir, self.stop, self.simulation = state_dir, stop, simulation
        self.grid, self.node_of, self.config_text = grid, node_of, config_text
        self.run_key, self.timeout = run_key, timeout
        self._unanswered: set[int] = set()  # joined nodes that did not answer the node-config query
        self._wire = {"down": 0, "up": 0, "eval_down": 0}  # payload bytes the messages carried (take_traffic)

    def _rejoined(self) -> None:
        """Hand the clients of a node that left the grid to a node that joined with the same
        ``partition-id`` (a restarted SuperNode gets new node id): without this they stayed lost
        for the rest of the run. Each new node is asked for its node config once; a node still
        listed keeps its clients (two nodes never share a partition)."""
        listed = set(self.grid.get_node_ids())
        parts = getattr(self.node_of, "partitions", None)
        if parts is None:
            return
        new = sorted(listed - set(parts) - self._unanswered)
        if new:
            app = _flwr()
            msgs = [(nid, app.Message(app.RecordDict({CONTROL: app.ConfigRecord({"ask": "node_config"})}),
                                      dst_node_id=nid, message_type=QUERY)) for nid in new]
            replies, lost = _exchange(self.grid, msgs, min(self.timeout, 60.0), self.stop)
            self._unanswered.update(lost)
            for nid, reply in replies.items():
                try:
                    parts[nid] = partition_of(reply.content.config_records[CONTROL], nid)
                except UserInputError as err:  # a node that joined with a bad config hosts nothing; the run goes on
                    warn(f"{err}; it takes no clients")
                    self._unanswered.add(nid)
        for cid, old in list(self.node_of.items()):
            if old in listed:
                continue
            heir = next((nid for nid in sorted(listed) if nid in parts and parts[nid] == parts.get(old)), None)
            if heir is not None:
                self.node_of[cid] = heir

    def where(self, cid: int) -> str:
        """``" on node ... (partition-id=P)"``: errors about client ``cid`` name its node."""
        return f" on {node_name(self.node_of, cid)}"

    def _message(self, kind: str, nid: int, rnd: int, jobs: list[tuple[int, Payload]]) -> Any:
        """One message to node ``nid`` carrying the steps of all its clients in ``jobs`` (in job
        order). Equal payloads travel once: a common broadcast (one object) or equal per-client
        ones (FedDF's model of an architecture group)."""
        app = _flwr()
        by_object: dict[int, int] = {}  # id(payload) -> slot
        by_content: dict[str, int] = {}  # sha256 of the blob -> slot
        records: dict[str, Any] = {}
        for _, payload in jobs:
            if id(payload) in by_object:
                continue
            blob = payload.to_bytes()  # serialized once: hashed, and sent if new
            digest = hashlib.sha256(blob).hexdigest()
            if digest not in by_content:
                by_content[digest] = len(by_content)
                records.update(_blob_records(blob, f".{by_content[digest]}"))
                self._wire["down" if kind == TRAIN else "eval_down"] += len(blob)
            by_object[id(payload)] = by_content[digest]
        control = app.ConfigRecord({
            "client_ids": [cid for cid, _ in jobs], "slots": [by_object[id(p)] for _, p in jobs],
            "state_versions": [self.store.committed.get(cid, -1) for cid, _ in jobs], "round": rnd,
            "run_key": self.run_key, "config": self.config_text, "state_dir": self.state_dir,
            "deadline_s": float(self.timeout)})
        return app.Message(app.RecordDict({**records, CONTROL: control}), dst_node_id=nid, message_type=kind,
                           group_id=str(rnd))

    @staticmethod
    def _batches(kind: str, jobs: list[tuple[int, Payload]], limits: Mapping[int, int]) -> list[list[tuple[int, Payload]]]:
        """A node's jobs as the messages that carry them (in job order): one message, except for
        train messages whose clients' uploads could exceed :data:`MAX_REPLY_BYTES` together (each
        client counted at its upload limit in ``limits``, ``engine.max_upload_mb``, or its
        broadcast's size), which are split so that every reply stays under it (a client alone may
        exceed it)."""
        if kind != TRAIN:  # evaluation replies carry a few metrics per client
            return [jobs]
        out: list[list[tuple[int, Payload]]] = [[]]
        size = 0
        for cid, payload in jobs:
            nbytes = limits.get(cid) or payload.nbytes()
            if out[-1] and size + nbytes > MAX_REPLY_BYTES:
                out.append([])
                size = 0
            out[-1].append((cid, payload))
            size += nbytes
        return out

    def _replies(self, kind: str, rnd: int, jobs: list[tuple[int, Payload]], limits: Mapping[int, int]
                 ) -> tuple[dict[int, Any], dict[int, str], dict[int, ClientError]]:
        """Exchange the messages of the nodes hosting clients of ``jobs`` (one per node, or more, see
        :meth:`_batches`; Flower's deployment starts a
        ClientApp process per message: one per client cost a process start, an import of torch
        and a rebuild of the federation per client and step). Returns ``(reply content by client,
        reasons by lost client, errors by client)``: a node that fails or does not reply loses its
        clients; a client step that raised an unexpected error on its node loses that client only;
        a client step that raised a :class:`UserInputError` (e.g. diverged local training), or a
        node that refused the message or could not build the run, is a
        :class:`~rafl.federation.screening.ClientError` of each client concerned, naming the node:
        never the run's error here (the engine decides whether enough clients remain).

        Raises:
            UserInputError: on the Simulation Runtime, a lost client (virtual nodes do not drop out).
            Stopped: the caller set ``stop``."""
        by_node: dict[int, list[tuple[int, Payload]]] = {}
        for cid, payload in jobs:
            by_node.setdefault(self.node_of[cid], []).append((cid, payload))
        batches = {(nid, i): batch for nid, js in by_node.items() for i, batch in enumerate(self._batches(kind, js, limits))}
        node_replies, node_lost = _exchange(
            self.grid, [(key, self._message(kind, key[0], rnd, js)) for key, js in batches.items()], self.timeout,
            self.stop)
        replies: dict[int, Any] = {}
        lost: dict[int, str] = {}
        errors: dict[int, ClientError] = {}
        for key, js in batches.items():
            if key in node_lost:
                lost.update({cid: f"{node_name(self.node_of, cid)}: {node_lost[key]}" for cid, _ in js})
                continue
            content = node_replies[key].content
            rec = content.config_records.get(CONTROL)
            if rec is not None and "user_error" in rec:  # the whole message: every client of it fails
                node = node_name(self.node_of, js[0][0])
                what = (f"{node} refused the {kind} message" if rec.get("refused")  # the node's trust boundary
                        else f"{str(rec.get('user_error_source', '')) or 'the node'} on {node}")
                for cid, _ in js:
                    errors[cid] = ClientError(one_line(str(rec["user_error"])), str(rec.get("user_error_field", ""))
                                              or None, what)
                continue
            failed = _json_object(rec, "client_errors")
            raised = _json_object(rec, "client_user_errors")
            for cid, _ in js:
                if str(cid) in failed:
                    lost[cid] = f"{node_name(self.node_of, cid)}: node error: {one_line(str(failed[str(cid)]))}"
                elif str(cid) in raised:
                    err = raised[str(cid)] if isinstance(raised[str(cid)], dict) else {"message": raised[str(cid)]}
                    errors[cid] = ClientError(one_line(str(err.get("message", ""))), str(err.get("field", "")) or None,
                                              f"{str(err.get('source', '')) or f'client {cid}'} on "
                                              f"{node_name(self.node_of, cid)}")
                else:
                    replies[cid] = content
        if lost and self.simulation:  # a virtual node fails only when the run is broken or stopped
            cid, why = min(lost.items())
            if self.stop is not None and self.stop.is_set():
                raise Stopped("interrupted")
            hint = "; raise engine.round_timeout_s for slower clients" if "no reply within" in why else ""
            raise UserInputError(f"{kind} in round {rnd} failed: {why}{hint}", source=f"client {cid} (Simulation Runtime)")
        return replies, lost, errors

    def train(self, rnd: int, jobs: list[tuple[int, Payload]], limits: Mapping[int, int]
              ) -> tuple[list[tuple[int, Payload]], dict[int, str], float]:
        """Send every ``(client_id, broadcast)`` job to its node (one message per node, see :meth:`_batches`); returns
        the uploads in job order, the clients lost with the reason, and the wall seconds the
        round's client steps took. A reply's upload is checked against its client's ``limits`` entry
        before it is parsed.

        Raises:
            UserInputError: every client of the round lost without a reply or with a node error
                (nothing to aggregate: the fleet is down or the app is broken); a lost client on
                the Simulation Runtime. A client's own error is returned in place of its upload
                (a :class:`~rafl.federation.screening.ClientError`), not raised.
            Stopped: the caller set ``stop``."""
        t0 = time.perf_counter()
        self._rejoined()
        replies, lost, errors = self._replies(TRAIN, rnd, jobs, limits)
        if jobs and not replies and not errors:
            cid, why = min(lost.items())
            raise UserInputError(f"round {rnd}: all {len(jobs)} sampled clients were lost (client {cid}: {why})",
                                 source=node_name(self.node_of, cid))
        uploads: list[tuple[int, Payload | RejectedUpload]] = []
        for cid, _ in jobs:
            if cid in errors:  # its step raised on its node: its failure (the engine decides about the run)
                uploads.append((cid, errors[cid]))
            elif cid in replies:
                self.store.pending[cid] = rnd  # the node wrote version rnd; committed with the checkpoint
                try:  # the wire bytes are checked against the limit before they are parsed
                    uploads.append((cid, records_to_payload(replies[cid], f"client {cid}", f".{cid}",
                                                            limits.get(cid))))
                except UserInputError as err:  # refused: the engine counts it and discards the client's state
                    uploads.append((cid, RejectedUpload(err.message, _blob_size(replies[cid], f".{cid}"))))
                up = uploads[-1][1]  # what its blob carried: the payload's bytes (a refused one: its size)
                self._wire["up"] += up.nbytes() if isinstance(up, Payload) else _blob_size(replies[cid], f".{cid}")
        return uploads, lost, time.perf_counter() - t0

    def take_traffic(self) -> dict[str, int]:
        """The payload bytes this runner's messages carried since the last call, as sent:
        ``down`` (train messages: each distinct payload once per message, so a broadcast that
        several clients of a node share travels once to that node), ``up`` (the uploads in the
        replies) and ``eval_down`` (evaluate messages). Flower's own framing and the control
        record are not counted. Resets the counts."""
        out, self._wire = self._wire, {"down": 0, "up": 0, "eval_down": 0}
        return out

    def evaluate(self, rnd: int, ids: list[int], broadcast: Payload) -> tuple[dict[int, dict[str, float]], dict[int, str]]:
        """The evaluation contract's counts of every client in ``ids``, computed on its node (one
        message per node), and the clients whose node failed, did not reply or whose evaluation
        raised on its node, with the reason (left out of the round's accuracies).

        Raises:
            UserInputError: no client evaluated at all.
            Stopped: the caller set ``stop``."""
        self._rejoined()
        replies, lost, errors = self._replies(EVALUATE, rnd, [(cid, broadcast) for cid in ids], {})
        lost.update({cid: f"{err.source}: {err.reason}" for cid, err in errors.items()})  # left out, not the run's end
        if ids and not replies:
            cid, why = min(lost.items())
            raise UserInputError(f"evaluation of round {rnd}: all {len(ids)} clients were lost (client {cid}: {why})",
                                 source=node_name(self.node_of, cid))
        return ({cid: {k: float(v) for k, v in replies[cid].metric_records[f"metrics.{cid}"].items()}
                 for cid in ids if cid in replies}, lost)

    def finish(self) -> dict[int, str]:
        """After the final checkpoint: tell every node which state version of its clients the
        run ended on, so it deletes the older ones (training messages do it during the run; the
        final round's evaluation deletes nothing). Best effort: returns the nodes that did not
        confirm, with the reason."""
        app = _flwr()
        by_node: dict[int, dict[str, int]] = {}
        for cid, version in self.store.committed.items():
            by_node.setdefault(self.node_of[cid], {})[str(cid)] = int(version)
        msgs = [(nid, app.Message(app.RecordDict({CONTROL: app.ConfigRecord({
            "ask": "commit", "committed": json.dumps(versions), "run_key": self.run_key,
            "state_dir": self.state_dir})}), dst_node_id=nid, message_type=QUERY)) for nid, versions in by_node.items()]
        return _refusals(*_exchange(self.grid, msgs, min(self.timeout, 60.0), self.stop))

    def discard(self, timeout: float = 10.0) -> dict[int, str]:
        """The run failed before its first complete round (its run dir is removed): tell every
        node to delete the run's client-state folder, which no resume can use, and wait up to
        ``timeout`` seconds (at most the round timeout) for each to confirm. Best effort, even
        after an interrupt (``stop`` is not consulted): returns the nodes that did not confirm,
        with the reason."""
        app = _flwr()
        msgs = [(nid, app.Message(app.RecordDict({CONTROL: app.ConfigRecord({
            "ask": "discard", "run_key": self.run_key, "state_dir": self.state_dir})}),
            dst_node_id=nid, message_type=QUERY)) for nid in sorted(set(self.node_of.values()))]
        return _refusals(*_exchange(self.grid, msgs, min(self.timeout, timeout)))


def _refusals(replies: dict[Any, Any], lost: dict[Any, str]) -> dict[Any, str]:
    """``lost`` plus the nodes whose reply to a commit/discard query says they refused it."""
    out = dict(lost)
    for nid, reply in replies.items():
        rec = reply.content.config_records.get(CONTROL)
        if rec is not None and "refused" in rec:
            out[nid] = f"refused: {rec['refused']}"
    return out


__all__ = ["MAX_REPLY_BYTES", "FlowerClients", "NodeMap", "Stopped", "discover_nodes", "node_name", "partition_of",
           "warm_nodes"]
