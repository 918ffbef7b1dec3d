"""Client steps in parallel worker processes (``engine.workers``).

:class:`WorkerClients` is a client runner (the interface of
:class:`~rafl.federation.runners.InProcessClients`): the round's client steps and evaluations run
in ``workers`` processes forked from this one, one torch thread each. Forking shares the
federation -- the in-memory dataset, the model templates, the algorithm -- copy-on-write: nothing
is pickled or copied per worker, whatever the dataset's layout. A job crosses a pipe as a few
integers plus the serialized download (:meth:`Payload.to_bytes`, sent once per worker and call);
the worker loads the client's committed state from the run's :class:`ClientStore`, runs the very
function the in-process runner runs (:func:`~rafl.federation.runners.train_client` /
:func:`~rafl.federation.runners.evaluate_client`), writes the new state version there and sends
back the upload's bytes. Every draw is seeded by ``(seed, client, round)`` and every worker runs
one torch thread, so a run's metrics and states are the same bit for bit for every number of
workers (with ``train.threads: 1``, the default, in the one-worker case, which runs in-process).

Faults: a worker that dies (a signal, the OOM killer, a crash in native code) fails the client it
was running -- counted and reported like a Flower node's lost client -- and is replaced; a
:class:`UserInputError` raised by a client step (e.g. diverged training) is that client's failure,
returned as a :class:`~rafl.federation.screening.ClientError` in place of its upload, as
in-process; any other error raised by the method stops the run as it does in-process.
Ctrl-C: workers ignore SIGINT; the run's process terminates them
(SIGTERM, upon which a worker removes the temporary file of a state write in progress) and the
interrupt propagates as before, so ``--resume`` repeats the round from the committed states.
Workers exit by themselves when the run's process disappears (their pipe closes).

The clients that never trained (``engine.eval_clients: all``) are evaluated once per architecture
(:func:`rafl.federation.runners.evaluate_untrained`), one job per group here.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Mapping
from multiprocessing.connection import wait
from typing import Any, ClassVar

import torch

from rafl.errors import UserInputError
from rafl.federation import events
from rafl.federation.payload import Payload
from rafl.federation.runners import (
    ClientRunner,
    InProcessClients,
    RunnerFactory,
    client_context,
    evaluate_client,
    evaluate_group,
    initial_groups,
    train_client,
)
from rafl.federation.screening import ClientError, RejectedUpload, check_meta, raw_nbytes, raw_size
from rafl.federation.store import ClientStore


def fork_available() -> bool:
    """Whether this platform can fork worker processes (Linux, macOS; not Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cgroup_cores(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The CPU quota of this process's cgroup (v2 ``cpu.max``: ``"<quota> <period>"`` microseconds)
    in cores, or None when there is none (``max``) or it cannot be read."""
    try:
        with open(path) as fh:
            quota, period = fh.read().split()[:2]
        return None if quota == "max" else max(1.0, int(quota) / int(period))
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """The CPU cores this run can expect to have to itself, >= 1: the cores it may run on
    (:func:`cpu_cores`, capped by a cgroup CPU quota) minus the other processes that keep them busy,
    i.e. the 1-minute load average less this run's own process (1), scaled to the share of the
    machine's cores this process may use and rounded to whole cores.

    The load average counts runnable processes over the whole machine; a worker beside a busy
    core gets only a share of it, so on a loaded machine more workers buy little and pay their
    start-up, copies-on-write and state I/O (``bench/round_speed.py``, beside a CPU hog)."""
    cores = cpu_cores()
    quota = _cgroup_cores()
    if quota is not None:
        cores = max(1, min(cores, int(quota)))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: trust the cores
        return cores
    others = max(0.0, load - 1.0) * cores / max(cores, os.cpu_count() or cores)
    return max(1, min(cores, cores - int(others + 0.5)))


def resolve_workers(workers: int | None, n_sampled: int, device: torch.device) -> int:
    """The number of worker processes of a run: ``workers``, or by default the CPU cores free for
    it (:func:`available_cores`, read once when the run starts) capped by the clients sampled per
    round (1 on a CUDA device or where fork is unavailable).

    Raises:
        UserInputError: ``workers`` is not an integer >= 1, or > 1 on a CUDA device (a forked
            process cannot use the parent's CUDA context) or without fork.
    """
    if workers is None:
        if device.type != "cpu" or not fork_available():
            return 1
        return max(1, min(available_cores(), n_sampled))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserInputError(f"is {workers!r}; allowed: an integer >= 1, or null (the CPU cores)", field="engine.workers")
    if workers > 1 and device.type != "cpu":
        raise UserInputError(f"is {workers}, but the clients compute on {device} (worker processes are for CPU "
                             "runs); allowed: 1, or null", field="engine.workers")
    if workers > 1 and not fork_available():
        raise UserInputError(f"is {workers}, but this platform cannot fork processes; allowed: 1, or null",
                             field="engine.workers")
    return workers


def runner(workers: int | None, n_sampled: int, device: torch.device) -> RunnerFactory:
    """The engine's default client runner factory ``(fed, store, seed) -> runner``:
    :class:`~rafl.federation.runners.InProcessClients` for one worker (:func:`resolve_workers`),
    else :class:`WorkerClients`."""
    n = resolve_workers(workers, n_sampled, device)
    if n == 1:
        return InProcessClients
    return lambda fed, store, seed: WorkerClients(fed, store, seed, n)


# ---------------------------------------------------------------------- worker process
def _portable_error(err: BaseException) -> tuple:
    """What of an exception crosses the pipe: a UserInputError's parts, else the pickled
    exception (or its type and text when it does not pickle)."""
    if isinstance(err, UserInputError):
        return ("user", err.message, err.source, err.field)
    try:
        blob = pickle.dumps(err)
        pickle.loads(blob)
        return ("pickled", blob)
    except Exception:  # noqa: BLE001 -- an exception whose state does not survive pickling
        return ("text", f"{type(err).__name__}: {err}")


def _worker_main(conn, others: list, fed, store_dir: str, seed: int) -> None:
    """A worker's loop: jobs from ``conn`` until ``None`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the run's process, which stops us

    def _terminate(signum, frame):  # SystemExit unwinds: an atomic write in progress deletes its temp file
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    for c in others:  # the run's ends of the other workers' pipes: let them see EOF when the run dies
        c.close()
    torch.set_num_threads(1)
    events.silence()  # the run's process shows the round's progress (its clients done, as replies come)

    def forward(event: str, info: dict) -> None:  # the batches of the client trained here, to the run's display
        if event == "batch":
            conn.send(("progress", event, info))

    with events.listening(forward):
        _serve(conn, fed, store_dir, seed)


def _serve(conn, fed, store_dir: str, seed: int) -> None:
    """A worker's jobs from ``conn`` until ``None`` or the pipe closes (:func:`_worker_main`)."""
    store = ClientStore(store_dir)
    downloads: dict[int, Payload] = {}
    shared_round: int | None = None
    shared: dict[tuple[str, str], dict[str, float]] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        kind = msg[0]
        if kind == "payload":
            downloads[msg[1]] = Payload.from_bytes(msg[2])
            continue
        if kind == "forget":
            downloads.clear()
            continue
        _, rnd, cid, committed, key, limit = msg
        store.committed = dict(committed)
        store.pending = {}
        try:
            if kind == "train":
                try:
                    upload, seconds = train_client(fed, store, client_context(fed, seed, cid, rnd), downloads[key])
                    result: Any = (encode_upload(upload, limit), seconds)
                except UserInputError as err:  # this client's failure (no state saved), not the run's
                    result = (ClientError.of(err), 0.0)
            elif kind == "evaluate":
                if shared_round != rnd:  # one global-set scoring per deployed model and round
                    shared_round, shared = rnd, {}
                result = evaluate_client(fed, store, client_context(fed, seed, cid, rnd), downloads[key], shared)
            else:  # "initial": cid is a group of never-trained clients
                result = evaluate_group(fed, store, seed, rnd, cid, downloads[key])
            conn.send(("ok", result))
        except Exception as err:  # noqa: BLE001 -- the run's process re-raises it
            conn.send(("error", _portable_error(err), traceback.format_exc()))


def encode_upload(upload: Any, limit: int | None) -> bytes | RejectedUpload:
    """A client's upload as the bytes the run's process receives, or the reason it is refused
    before any byte of it crosses: metadata of a type the wire format does not carry
    (:func:`rafl.federation.screening.check_meta`), more than ``limit`` bytes (counted without
    serializing, :func:`rafl.federation.screening.raw_nbytes`), or anything that fails to serialize.
    The run's process screens what it receives as any other upload."""
    try:
        check_meta(upload)
        size = raw_nbytes(upload)
        if limit is not None and size > limit:
            return RejectedUpload(f"holds {size} bytes; allowed: at most {limit} (engine.max_upload_mb)", size)
        return upload.to_bytes()
    except UserInputError as err:
        return RejectedUpload(str(err), raw_size(upload))
    except Exception as err:  # noqa: BLE001 - what the client handed over does not serialize: its upload's fault
        return RejectedUpload(f"not a valid payload ({type(err).__name__}: {str(err)[:120]})", raw_size(upload))


def decode_upload(data: bytes | RejectedUpload, sender: str, limit: int | None) -> Payload | RejectedUpload:
    """What :func:`encode_upload` sent, as a payload (:meth:`Payload.from_bytes`: the size and the
    header checked before a tensor is allocated) or the reason it is refused."""
    if isinstance(data, RejectedUpload):
        return data
    try:
        return Payload.from_bytes(data, sender, max_bytes=limit)
    except UserInputError as err:
        return RejectedUpload(err.message if err.field is None else f"{err.field}: {err.message}", len(data))


class _Worker:
    def __init__(self, ctx, others: list, fed, store_dir: str, seed: int):
        self.conn, child = ctx.Pipe(duplex=True)
        # the child closes every run-side pipe end it inherits, its own included
        self.proc = ctx.Process(target=_worker_main, args=(child, [*others, self.conn], fed, store_dir, seed),
                                daemon=True)
        self.proc.start()
        child.close()
        self.sent: set[int] = set()  # payload keys this worker holds
        self.job: tuple | None = None


class _Interrupted(list):
    """The signals that arrived while the run's process waited for its workers (see
    :func:`_interrupt_flag`); :meth:`raise_` raises what each would have raised at once."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: dict[int, Any] = {}

    def raise_(self) -> None:
        if signal.SIGTERM in self:  # the handler installed for SIGTERM (rafl's CLI: SystemExit(143))
            self.previous[signal.SIGTERM](signal.SIGTERM, None)
        raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupt_flag() -> Iterator[_Interrupted]:
    """While the run's process waits for its workers, Ctrl-C (SIGINT) and SIGTERM append to the
    yielded list instead of raising at once; the wait loop raises (:meth:`_Interrupted.raise_`)
    itself. An exception raised by a signal handler is lost when the handler fires inside a
    finalizer (``__del__``) or one of Python's at-fork callbacks, which a process juggling pipes and
    forking child processes runs often. Only in the main thread; SIGINT only over Python's default
    handler, SIGTERM only over a Python handler someone installed (rafl's CLI installs one)."""
    flag = _Interrupted()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        flag.previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
    if callable(signal.getsignal(signal.SIGTERM)):
        flag.previous[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
    for signum in flag.previous:
        signal.signal(signum, lambda signum, frame: flag.append(signum))
    try:
        yield flag
    finally:
        for signum, previous in flag.previous.items():
            signal.signal(signum, previous)
    if flag:  # arrived after the wait loop's last look: not lost
        flag.raise_()


def _stop(workers: list[_Worker], kill: bool) -> None:
    for w in workers:
        if kill and w.proc.is_alive():
            w.proc.terminate()
        else:
            try:
                w.conn.send(None)
            except OSError:
                pass
    for w in workers:
        w.proc.join(timeout=10)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()


class WorkerClients(ClientRunner):
    """Runs the client steps in ``workers`` forked processes (see the module docstring).

    Args:
        fed: the federation (shared with the workers by fork, at their first job).
        store: the engine's :class:`ClientStore` (its committed versions travel with each job).
        seed: the run seed.
        workers: number of processes (>= 1).
    """

    shares_initial_evaluation: ClassVar[bool] = True

    def __init__(self, fed, store: ClientStore, seed: int, workers: int):
        self.fed, self.store, self.seed, self.n = fed, store, seed, int(workers)
        self._ctx = multiprocessing.get_context("fork")
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop, self._workers, True)

    # ------------------------------------------------------------------ pool
    def _spawn(self) -> _Worker:
        w = _Worker(self._ctx, [o.conn for o in self._workers], self.fed, str(self.store.directory), self.seed)
        self._workers.append(w)
        return w

    def close(self) -> None:
        """Stop the worker processes (idempotent; the next call forks new ones)."""
        _stop(self._workers, kill=False)
        self._workers.clear()

    def _drop(self, w: _Worker) -> None:
        w.proc.join(timeout=10)
        w.conn.close()
        self._workers.remove(w)

    def _job_size(self, who) -> int:
        """A job's work, in samples: its clients' training samples (an evaluation group: all of them)."""
        ids = who if isinstance(who, list) else [who]
        return sum(int(getattr(self.fed.clients[c], "n_samples", 0) or 0) for c in ids)

    def where(self, cid: int) -> str:
        """Where client ``cid`` computes, as errors append it ("" : this machine)."""
        return ""

    def _run(self, kind: str, rnd: int, jobs: list[tuple[Any, Payload]], limits: Mapping[int, int] | None = None
             ) -> tuple[dict[int, Any], dict[int, str]]:
        """Run ``jobs`` (``(client id or group, download)``) on the workers, each job on the next
        free worker, the largest (most samples) first; ``limits`` (train jobs): ``client id -> the
        largest upload accepted``, checked in the worker. Returns ``(results by job index, failures
        by job index)``."""
        keys: dict[int, int] = {}
        blobs: dict[int, bytes] = {}
        for _, down in jobs:
            if id(down) not in keys:
                keys[id(down)] = len(keys)
                blobs[keys[id(down)]] = down.to_bytes()
        # the largest jobs first (longest-processing-time-first: the workers finish about together);
        # results are keyed by job index, so the order changes no number
        todo = sorted(range(len(jobs)), key=lambda i: (self._job_size(jobs[i][0]), -i))
        results: dict[int, Any] = {}
        failed: dict[int, str] = {}
        for w in list(self._workers):
            w.sent.clear()
            try:
                w.conn.send(("forget",))
            except OSError:  # it died while idle: a new one replaces it
                self._drop(w)
        try:
            with _interrupt_flag() as interrupted:
                self._loop(kind, rnd, jobs, keys, blobs, todo, results, failed, interrupted, limits)
        except BaseException:
            _stop(self._workers, kill=True)  # Ctrl-C, or a method's error: stop every worker now
            self._workers.clear()
            raise
        return results, failed

    def _loop(self, kind, rnd, jobs, keys, blobs, todo, results, failed, interrupted, limits) -> None:
        """Dispatch ``todo`` (job indices, last first) and collect until every job is done.

        A method's error raised in a job does not stop the loop at once: the jobs before it in job
        order still run (those after it are dropped), and the error of the first failing job in job
        order is raised, the one the in-process runner raises. Which worker answers first then
        decides nothing."""
        errors: dict[int, tuple] = {}

        def needed(i: int) -> bool:
            return not errors or i < min(errors)

        while todo or any(w.job is not None and needed(w.job[0]) for w in self._workers):
            if interrupted:
                interrupted.raise_()
            for w in [w for w in self._workers if w.job is None and not w.proc.is_alive()]:
                self._drop(w)
            while len(self._workers) < min(self.n, len(todo) + sum(w.job is not None for w in self._workers)):
                self._spawn()
            for w in self._workers:
                if w.job is None and todo:
                    i = todo.pop()
                    who, down = jobs[i]
                    key = keys[id(down)]
                    if key not in w.sent:
                        w.conn.send(("payload", key, blobs[key]))
                        w.sent.add(key)
                    ids = who if isinstance(who, list) else [who]
                    committed = {c: self.store.committed[c] for c in ids if c in self.store.committed}
                    w.conn.send((kind, rnd, who, committed, key, limits.get(who) if limits is not None else None))
                    w.job = (i,)
            busy = [w for w in self._workers if w.job is not None]
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=0.5)
            for w in busy:
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == "progress":  # a batch of the job it is running
                        if kind == "train":
                            events.report(msg[1], client=jobs[w.job[0]][0], **msg[2])
                        continue
                    if msg is not None:
                        i = w.job[0]
                        w.job = None
                        if msg[0] == "ok":
                            results[i] = msg[1]
                            if kind == "train":
                                events.report("client_done", client=jobs[i][0])
                        else:
                            errors[i] = (msg[1], msg[2])
                            todo[:] = [j for j in todo if needed(j)]
                        continue
                if w.job is not None and (w.proc.sentinel in ready or w.conn in ready):
                    w.proc.join(timeout=10)
                    failed[w.job[0]] = f"its worker process died (exit code {w.proc.exitcode})"
                    w.job = None
                    self._drop(w)
        if interrupted:
            interrupted.raise_()
        if errors:
            self._raise(*errors[min(errors)])

    @staticmethod
    def _raise(err: tuple, trace: str) -> None:
        """Re-raise a method's error from a worker as the in-process runner would have raised it."""
        if err[0] == "user":
            raise UserInputError(err[1], source=err[2], field=err[3])
        exc = pickle.loads(err[1]) if err[0] == "pickled" else RuntimeError(err[1])
        exc.add_note(f"raised in a worker process:\n{trace}")
        raise exc

    # ------------------------------------------------------------------ runner interface
    def train(self, rnd: int, jobs: list[tuple[int, Payload]], limits: Mapping[int, int]
              ) -> tuple[list[tuple[int, Payload]], dict[int, str], float]:
        """``client_update`` of every ``(client_id, download)`` in ``jobs`` on the workers; the new
        states are pending versions of round ``rnd`` in the store. A worker checks an upload's bytes
        against its client's ``limits`` entry before it is parsed.

        Returns:
            ``(uploads, failed, seconds)``: ``(client_id, upload)`` in job order for the clients
            that completed (a :class:`~rafl.federation.screening.ClientError` for a client whose
            step raised a UserInputError), the clients whose worker died with the reason, and the wall seconds
            of the parallel section (client computation and state I/O)."""
        t0 = time.perf_counter()
        results, failed = self._run("train", rnd, jobs, limits)
        uploads = []
        for i, (cid, _) in enumerate(jobs):
            if i in results:
                uploads.append((cid, decode_upload(results[i][0], f"client {cid}", limits.get(cid))))
                if not isinstance(results[i][0], ClientError):
                    self.store.pending[cid] = rnd
        return uploads, {jobs[i][0]: why for i, why in failed.items()}, time.perf_counter() - t0

    def evaluate(self, rnd: int, ids: list[int], broadcast: Payload) -> tuple[dict[int, dict[str, float]], dict[int, str]]:
        """The evaluation contract's counts of every client in ``ids`` (committed states), and the
        clients whose worker died, with the reason."""
        results, failed = self._run("evaluate", rnd, [(cid, broadcast) for cid in ids])
        return ({ids[i]: results[i] for i in sorted(results)}, {ids[i]: why for i, why in failed.items()})

    def evaluate_untrained(self, rnd: int, ids: list[int], broadcast: Payload
                         ) -> tuple[list[tuple[list[int], dict[str, float]]], dict[int, str]]:
        """:func:`rafl.federation.runners.evaluate_untrained` with one job per model group; the clients of a group whose
        worker died are returned with the reason."""
        groups = initial_groups(self.fed, ids)
        results, failed = self._run("initial", rnd, [(g, broadcast) for g in groups])
        lost = {cid: why for i, why in failed.items() for cid in groups[i]}
        return [(groups[i], results[i]) for i in sorted(results)], lost


__all__ = ["WorkerClients", "runner", "resolve_workers", "cpu_cores", "available_cores", "fork_available"]
