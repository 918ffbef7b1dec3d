"""Accuracy estimators for the search: measured (BN-recalibrated subnet on validation data) and
predicted (an MLP on the arch encoding trained on measured subnets).

Both follow Once-for-All (Cai et al., ICLR 2020, Sec. 3.2 BN recalibration, Sec. 3.4 accuracy
predictor). The measured estimator touches only server-side data: calibration images from the
server's pool-train part, accuracy on the server's validation split.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence
from multiprocessing import connection as mp_connection
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from rafl import seeds
from rafl.errors import UserInputError
from rafl.io import atomic_write_json
from rafl.search.genome import Population
from rafl.search.predictor import AccuracyPredictor, PredictorFit, train_predictor
from rafl.supernet import extract_subnet, recalibrate_bn
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.supernet.model import prepare_input


def check_eval_data(val_data: tuple[Tensor, Tensor], calib_data: Tensor, n_classes: int) -> None:
    """Validate the search's data.

    Args:
        val_data: ``(images (N, C, H, W) float32, labels (N,) int64)``, N >= 1.
        calib_data: images ``(M, C, H, W)`` for BN recalibration, M >= 1.
    Raises:
        UserInputError: an empty validation split or calibration set, mismatched shapes, or labels
            outside ``[0, n_classes)``.
    """
    if not (isinstance(val_data, (tuple, list)) and len(val_data) == 2):
        raise UserInputError("expected (images, labels)", field="val_data")
    images, labels = val_data
    if images.ndim != 4 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise UserInputError(f"expected images (N, C, H, W) and labels (N,), got {tuple(images.shape)} "
                             f"and {tuple(labels.shape)}", field="val_data")
    if images.shape[0] == 0:
        raise UserInputError("the validation split is empty (needs >= 1 labelled sample on the server)",
                             field="val_data")
    if calib_data.ndim != 4 or calib_data.shape[0] == 0:
        raise UserInputError(f"needs >= 1 image (M, C, H, W), got shape {tuple(calib_data.shape)}",
                             field="calib_data")
    if calib_data.shape[1:] != images.shape[1:]:
        raise UserInputError(f"image shape {tuple(calib_data.shape[1:])} differs from the validation "
                             f"images' {tuple(images.shape[1:])}", field="calib_data")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        raise UserInputError(f"labels must be in [0, {n_classes}), got [{int(labels.min())}, "
                             f"{int(labels.max())}]", field="val_data")


def tensor_fingerprint(*tensors: Tensor) -> str:
    """SHA-256 (hex, 16 chars) of the bytes of ``tensors`` (their dtype and shape included)."""
    h = hashlib.sha256()
    for x in tensors:
        x = x.detach().cpu().contiguous()
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(x.numpy().tobytes() if x.dtype != torch.bfloat16 else x.float().numpy().tobytes())
    return h.hexdigest()[:16]


def supernet_fingerprint(supernet) -> str:
    """SHA-256 (hex, 16 chars) of a supernet's search space and every tensor of its state dict:
    the key of the per-supernet measurement cache (another checkpoint, another key)."""
    state = supernet.state_dict()
    h = hashlib.sha256(repr(supernet.space).encode())
    h.update(tensor_fingerprint(*(state[k] for k in sorted(state))).encode())
    return h.hexdigest()[:16]


def measurement_cache_dir() -> Path:
    """``$RAFL_CACHE_DIR/search-measurements`` (default ``~/.cache/rafl``)."""
    return Path(os.environ.get("RAFL_CACHE_DIR") or Path.home() / ".cache" / "rafl") / "search-measurements"


class MeasuredAccuracy:
    """Top-1 accuracy (fraction 0..1) of extracted, BN-recalibrated subnets; cached per arch.

    For each arch: :func:`rafl.supernet.extract_subnet`, :func:`rafl.supernet.recalibrate_bn` on
    ``calib_batches`` batches of ``calib_data``, then accuracy on ``val_data`` in eval mode
    (OFA's measurement of its predictor's training set, Cai et al. 2020, Sec. 3.2 / 3.4).
    :meth:`measure` works in batches: archs grouped by resolution, the validation and
    calibration images resized once per resolution, channels-last inference.

    Args:
        supernet: a trained :class:`rafl.supernet.Supernet` (left unchanged).
        val_data: ``(images (N, C, H, W), labels (N,))`` the server's validation split.
        calib_data: ``(M, C, H, W)`` server images for BN recalibration (pool-train part).
        batch_size: images per forward pass. calib_batches: batches used to recalibrate BN.
        cache_dir: a folder for the on-disk cache of measurements (None: in memory only). The
            file is keyed by :func:`supernet_fingerprint`, the validation and calibration images
            and labels, ``batch_size`` and ``calib_batches``, so a later search of the same
            supernet on the same data measures no arch twice; it is rewritten (atomically) after
            every batch of measurements, so an interrupted run keeps what it measured.
        workers: processes measuring in parallel when many archs are to be measured (forked from
            this one, one torch thread each, each a share of the archs; the same accuracies as one
            process: every arch is measured alone, in eval mode); None = the CPU cores; 1 (or no
            fork on this platform, or a CUDA supernet) = in this process.
    Raises:
        UserInputError: see :func:`check_eval_data`.
    """

    def __init__(self, supernet, val_data: tuple[Tensor, Tensor], calib_data: Tensor, *,
                 batch_size: int = 128, calib_batches: int = 2, cache_dir: str | Path | None = None,
                 workers: int | None = 1):
        check_eval_data(val_data, calib_data, supernet.space.n_classes)
        self.supernet = supernet
        self.space: SearchSpace = supernet.space
        self.images, self.labels = val_data[0].float(), val_data[1].long()
        self.calib_images = calib_data.float()
        n_cal = -(-calib_data.shape[0] // batch_size)
        self.calib_batches = max(1, min(calib_batches, n_cal))
        self.batch_size = batch_size
        self.workers = workers
        self.cache: dict[str, float] = {}
        #: canonical arch -> (accuracy on half A, on half B) of the validation split (:attr:`half_a`)
        self.halves: dict[str, tuple[float, float]] = {}
        # the split-half noise ceiling's halves: a fixed random half of the validation images
        # (seed 0) and the rest; from the same predictions as the accuracy (no extra pass)
        n_val = self.images.shape[0]
        self.half_a = torch.zeros(n_val, dtype=torch.bool)
        self.half_a[torch.as_tensor(seeds.generator("measurement-halves").permutation(n_val)[: n_val // 2])] = True
        self.cache_path: Path | None = None
        self.n_measured = 0  # archs measured by this object (cache hits excluded)
        self._resized: dict[int, tuple[Tensor, list[Tensor]]] = {}
        if cache_dir is not None:
            key = tensor_fingerprint(self.images, self.labels,
                                     self.calib_images[: self.calib_batches * batch_size])
            self.cache_path = (Path(cache_dir) / f"{supernet_fingerprint(supernet)}-{key}-b{batch_size}"
                               f"c{self.calib_batches}.json")
            self._load_cache()

    # ------------------------------------------------------------------ disk cache
    def _load_cache(self) -> None:
        try:
            data = json.loads(self.cache_path.read_text())
            acc = data["accuracy"]
            self.cache.update({str(k): float(v) for k, v in acc.items()})
            self.halves.update({str(k): (float(v[0]), float(v[1])) for k, v in data.get("halves", {}).items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # no cache yet, or a damaged one: measure again

    def _save_cache(self) -> None:
        if self.cache_path is None:
            return
        try:
            atomic_write_json(self.cache_path, {
                "format": "rafl-measured-accuracy/1", "n_val": int(self.images.shape[0]),
                "note": "top-1 (fraction) on the server-val split after BN recalibration, per canonical arch",
                "accuracy": self.cache, "halves": {k: list(v) for k, v in self.halves.items()}})
        except OSError:
            self.cache_path = None  # read-only cache folder: keep measuring in memory

    # ------------------------------------------------------------------ measuring
    def _inputs(self, r: int) -> tuple[Tensor, list[Tensor]]:
        """Validation images and calibration batches resized to ``r`` once, channels-last."""
        if r not in self._resized:
            cl = torch.channels_last
            val = prepare_input(self.images, r).contiguous(memory_format=cl)
            cal = prepare_input(self.calib_images[: self.calib_batches * self.batch_size], r)
            cal = [cal[i:i + self.batch_size].contiguous(memory_format=cl)
                   for i in range(0, cal.shape[0], self.batch_size)]
            self._resized = {r: (val, cal)}  # one resolution at a time (archs come grouped by r)
        return self._resized[r]

    def _measure_one(self, arch: ArchConfig) -> tuple[float, float, float]:
        """``(accuracy, accuracy on half A, accuracy on half B)`` of one arch (fractions 0..1)."""
        was_training = self.supernet.training
        self.supernet.eval()
        try:
            sub = extract_subnet(self.supernet, arch)
        finally:
            self.supernet.train(was_training)
        val, cal = self._inputs(arch.r)
        sub = sub.to(memory_format=torch.channels_last)
        recalibrate_bn(sub, cal, n_batches=self.calib_batches)
        sub.eval()
        hits = torch.empty(val.shape[0], dtype=torch.bool)
        with torch.inference_mode():
            for i in range(0, val.shape[0], self.batch_size):
                logits = sub(val[i:i + self.batch_size])
                hits[i:i + self.batch_size] = logits.argmax(1) == self.labels[i:i + self.batch_size]
        a, b = hits[self.half_a], hits[~self.half_a]
        return (int(hits.sum()) / hits.numel(), int(a.sum()) / max(1, a.numel()), int(b.sum()) / max(1, b.numel()))

    def _store(self, key: str, got: tuple[float, float, float]) -> None:
        self.cache[key] = got[0]
        self.halves[key] = (got[1], got[2])
        self.n_measured += 1

    def measure(self, archs: Sequence[ArchConfig], progress: bool = False, desc: str = "measuring subnets",
                save_every: float = 5.0, hint: str | None = None) -> np.ndarray:
        """``(len(archs),)`` float64 accuracies (fraction 0..1); cached per canonical arch.

        The archs not in the cache are measured grouped by resolution (in :attr:`workers`
        processes when there are enough of them), with a progress bar advanced per subnet (counts
        and an ETA) when ``progress``; when more than one is to be measured, a first line on
        stderr says how many, on how many images, and about how long it will take (the first
        subnet, measured here, timed), followed by ``hint`` (how to make it shorter). The disk
        cache (if any) is rewritten at most every ``save_every`` seconds, at the end, and when
        the measuring is interrupted (Ctrl-C, SIGTERM: the workers are stopped at once), so
        every subnet measured is kept.
        """
        keys = [a.canonical(self.space).to_string() for a in archs]
        todo: dict[str, ArchConfig] = {}
        for a, k in zip(archs, keys):
            if k not in self.cache:
                todo.setdefault(k, a.canonical(self.space))
        items = sorted(todo.items(), key=lambda kv: kv[1].r)
        if not items:
            return np.asarray([self.cache[k] for k in keys], dtype=np.float64)
        n_before = self.n_measured
        try:
            if progress and len(items) > 1:
                t0 = time.perf_counter()
                self._store(*self._measured_item(items[0]))
                items = items[1:]
                each = time.perf_counter() - t0
                eta = each * len(items) / max(1, self._worker_count(len(items)))
                tqdm.write(f"{desc}: {len(items) + 1} subnets on {self.images.shape[0]:,} images "
                           f"(+ BN recalibration on {self.calib_batches * self.batch_size:,}), "
                           f"{max(1, self._worker_count(len(items)))} process(es): about {_duration(eta)} "
                           f"({each:.2g} s for the first)" + (f"; {hint}" if hint else ""), file=sys.stderr)
            bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False, file=sys.stderr)
            with bar:
                workers = self._worker_count(len(items))
                if workers > 1:
                    self._measure_forked(items, workers, bar, save_every)
                else:
                    last = time.monotonic()
                    for item in items:
                        self._store(*self._measured_item(item))
                        bar.update(1)
                        if time.monotonic() - last >= save_every:
                            self._save_cache()
                            last = time.monotonic()
        finally:
            if self.n_measured > n_before:
                self._save_cache()  # also when interrupted: what was measured is kept
        return np.asarray([self.cache[k] for k in keys], dtype=np.float64)

    def _measured_item(self, item: tuple[str, ArchConfig]) -> tuple[str, tuple[float, float, float]]:
        return item[0], self._measure_one(item[1])

    def __call__(self, pop: Population) -> np.ndarray:
        """Accuracy of every member of a :class:`Population` (the evolution's score function)."""
        return self.measure(pop.archs())

    #: fewer archs than this per worker are measured in this process (forking costs more)
    MIN_PER_WORKER = 8

    def _worker_count(self, n_todo: int) -> int:
        workers = self.workers
        if workers is None:
            try:
                workers = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                workers = os.cpu_count() or 1
        on_cpu = all(p.device.type == "cpu" for p in self.supernet.parameters())
        if workers <= 1 or not on_cpu or "fork" not in multiprocessing.get_all_start_methods():
            return 1
        return max(1, min(int(workers), n_todo // self.MIN_PER_WORKER))

    def _measure_forked(self, items: list[tuple[str, ArchConfig]], workers: int, bar, save_every: float) -> None:
        """Measure ``items`` in ``workers`` forked processes (an interleaved share each, one torch
        thread each); every accuracy comes back through a pipe as soon as it is measured (the bar
        advances per subnet). The supernet and images are shared with the children by fork
        (copy-on-write); only arch keys and accuracies cross the pipes. On any exception here
        (Ctrl-C, SIGTERM's ``SystemExit``) the workers are terminated at once (SIGTERM, then
        SIGKILL after 1 s) before it propagates.

        Raises:
            RuntimeError: a worker failed (its error) or died (its exit code).
        """
        global _FORKED
        ctx = multiprocessing.get_context("fork")
        procs, conns = [], []
        _FORKED = self
        try:
            for w in range(workers):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_measure_share, args=(items[w::workers], send), daemon=True)
                proc.start()
                send.close()
                procs.append(proc)
                conns.append(recv)
            waiting = dict(zip(conns, procs))
            last = time.monotonic()
            while waiting:
                for conn in mp_connection.wait(list(waiting), timeout=1.0):
                    try:
                        msg = conn.recv()
                    except EOFError:
                        proc = waiting.pop(conn)
                        proc.join(1.0)
                        raise RuntimeError(f"a process measuring subnets died (exit code {proc.exitcode})") from None
                    if msg is None:  # this worker is done
                        waiting.pop(conn)
                    elif msg[0] == "error":
                        raise RuntimeError(f"a process measuring subnets failed: {msg[1]}")
                    else:
                        self._store(msg[1], msg[2])
                        bar.update(1)
                if time.monotonic() - last >= save_every:
                    self._save_cache()
                    last = time.monotonic()
        finally:
            _FORKED = None
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(1.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            for conn in conns:
                conn.close()


#: the estimator a forked measuring process works for (set by the parent just before the fork)
_FORKED: MeasuredAccuracy | None = None


def _measure_share(items: list[tuple[str, ArchConfig]], conn) -> None:
    """In a forked worker: send ``("ok", key, (accuracy, half A, half B))`` per arch, then None
    (``("error", text)`` on a failure). Ctrl-C is the parent's to handle (it stops us with
    SIGTERM, which ends this process at once: the default action)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
    try:
        for key, arch in items:
            conn.send(("ok", key, _FORKED._measure_one(arch)))
        conn.send(None)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{err.__class__.__name__}: {err}"))
    finally:
        conn.close()


def _duration(seconds: float) -> str:
    """``seconds`` for people: ``45 s``, ``3.5 min``, ``1.2 h``."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{seconds / 60:.2g} min"
    return f"{seconds / 3600:.2g} h"


#: archs drawn per block by :func:`sample_across_space` (its draws do not depend on ``n``)
SAMPLE_BLOCK = 16


def sample_across_space(space: SearchSpace, n: int, seed: int = 0) -> list[ArchConfig]:
    """``n`` distinct archs for the predictor's training set, spread over the whole space.

    The smallest and the largest arch, then uniformly random archs (OFA samples its predictor's
    training set uniformly, Cai et al. 2020, Sec. 3.4) with the resolution stratified (every
    resolution equally often) so that no resolution is under-represented by chance. The random
    archs are drawn in blocks of :data:`SAMPLE_BLOCK` from one generator, so the list for ``n`` is
    the first ``n`` of the list for any larger count (a search with more predictor samples
    measures only the archs a smaller one did not: the quickstart's 16 are the first 16 of 500).
    Fewer than ``n`` only if the space has fewer distinct archs.
    """
    rng = seeds.generator("predictor-samples", seed)
    archs: dict[str, ArchConfig] = {}
    for a in (space.smallest(), space.largest()):
        archs[a.canonical(space).to_string()] = a.canonical(space)
    n_r = len(space.resolutions)
    drawn = 0
    for _ in range(50 + 4 * (n // SAMPLE_BLOCK)):
        if len(archs) >= n:
            break
        pop = Population.sample(space, SAMPLE_BLOCK, rng)
        pop.r[:] = (np.arange(len(pop)) + drawn) % n_r  # stratified resolution
        drawn += len(pop)
        for a in pop.canonical().archs():
            if len(archs) < n:
                archs.setdefault(a.to_string(), a)
    return list(archs.values())


class PredictedAccuracy:
    """Score function of the evolution: :class:`AccuracyPredictor` on :meth:`Population.encode`."""

    def __init__(self, predictor: AccuracyPredictor, fit: PredictorFit | None = None):
        self.predictor = predictor
        self.fit = fit

    def __call__(self, pop: Population) -> np.ndarray:
        """``(P,)`` float64 predicted accuracy (fraction 0..1)."""
        return self.predictor.predict(pop.encode())

    @classmethod
    def from_measurements(cls, measured, n_samples: int, seed: int = 0, *,
                          folds: int = 4, hidden: int = 128, epochs: int = 400,
                          progress: bool = True) -> PredictedAccuracy:
        """Measure ``n_samples`` distinct archs spread over the space (:func:`sample_across_space`)
        and train the predictor on them (OFA Sec. 3.4); Kendall tau and RMSE by ``folds``-fold CV.
        ``measured``: a :class:`MeasuredAccuracy`, or any object with its ``space`` and
        ``measure(archs, progress=, desc=)`` (the search's known-or-measured accuracies).

        Raises:
            UserInputError: ``n_samples < 4``.
        """
        if n_samples < 4:
            raise UserInputError(f"must be >= 4, got {n_samples}", field="search.predictor_samples")
        space = measured.space
        arch_list = sample_across_space(space, n_samples, seed)
        acc = measured.measure(arch_list, progress=progress, desc="measuring subnets for the predictor",
                               hint=f"fewer with --predictor-samples (now {n_samples}; the predictor ranks worse "
                                    "below ~200)")
        x = Population.from_archs(space, arch_list).encode()
        model, fit = train_predictor(x, acc, folds=folds, hidden=hidden, epochs=epochs, seed=seed)
        return cls(model, fit)


__all__ = [
    "MeasuredAccuracy",
    "PredictedAccuracy",
    "check_eval_data",
    "measurement_cache_dir",
    "sample_across_space",
    "supernet_fingerprint",
    "tensor_fingerprint",
]
