"""Accuracy estimators for the search: measured (BN-recalibrated subnet on validation data) and
predicted (an MLP on the arch encoding trained on measured subnets).

Both follow Once-for-All (Cai et al., ICLR 2020, Sec. 3.2 BN recalibration, Sec. 3.4 accuracy
predictor). The measured estimator touches only server-side data: calibration images from the
server's pool-train part, accuracy on the server's validation split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from rafl.errors import UserInputError
from rafl.search.genome import Population
from rafl.search.predictor import AccuracyPredictor, PredictorFit, train_predictor
from rafl.supernet.arch import ArchConfig, SearchSpace


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


class MeasuredAccuracy:
    """Top-1 accuracy (fraction 0..1) of extracted, BN-recalibrated subnets; cached per arch.

    For each arch: :func:`rafl.supernet.extract_subnet`, :func:`rafl.supernet.recalibrate_bn` on
    ``calib_batches`` batches of ``calib_data``, then accuracy on ``val_data`` in eval mode.

    Args:
        supernet: a trained :class:`rafl.supernet.Supernet` (left unchanged).
        val_data: ``(images (N, C, H, W), labels (N,))`` the server's validation split.
        calib_data: ``(M, C, H, W)`` server images for BN recalibration (pool-train part).
        batch_size: images per forward pass. calib_batches: batches used to recalibrate BN.
    Raises:
        UserInputError: see :func:`check_eval_data`.
    """

    def __init__(self, supernet, val_data: tuple[Tensor, Tensor], calib_data: Tensor, *,
                 batch_size: int = 128, calib_batches: int = 2):
        check_eval_data(val_data, calib_data, supernet.space.n_classes)
        self.supernet = supernet
        self.space: SearchSpace = supernet.space
        self.images, self.labels = val_data[0].float(), val_data[1].long()
        self.calib = [calib_data[i:i + batch_size].float() for i in range(0, calib_data.shape[0], batch_size)]
        self.calib_batches = max(1, min(calib_batches, len(self.calib)))
        self.batch_size = batch_size
        self.cache: dict[str, float] = {}

    def _measure_one(self, arch: ArchConfig) -> float:
        from rafl.supernet import extract_subnet, recalibrate_bn

        was_training = self.supernet.training
        self.supernet.eval()
        try:
            sub = extract_subnet(self.supernet, arch)
        finally:
            self.supernet.train(was_training)
        recalibrate_bn(sub, self.calib, n_batches=self.calib_batches)
        sub.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, self.images.shape[0], self.batch_size):
                logits = sub(self.images[i:i + self.batch_size])
                correct += int((logits.argmax(1) == self.labels[i:i + self.batch_size]).sum())
        return correct / self.images.shape[0]

    def measure(self, archs: Sequence[ArchConfig], progress: bool = False, desc: str = "measuring subnets"
                ) -> np.ndarray:
        """``(len(archs),)`` float64 accuracies (fraction 0..1); cached per canonical arch."""
        out = np.empty(len(archs), dtype=np.float64)
        todo = [i for i, a in enumerate(archs) if a.canonical(self.space).to_string() not in self.cache]
        bar = tqdm(total=len(todo), desc=desc, disable=not progress or not todo, leave=False)
        for i, arch in enumerate(archs):
            key = arch.canonical(self.space).to_string()
            if key not in self.cache:
                self.cache[key] = self._measure_one(arch.canonical(self.space))
                bar.update(1)
            out[i] = self.cache[key]
        bar.close()
        return out

    def __call__(self, pop: Population) -> np.ndarray:
        """Accuracy of every member of a :class:`Population` (the evolution's score function)."""
        return self.measure(pop.archs())


class PredictedAccuracy:
    """Score function of the evolution: :class:`AccuracyPredictor` on :meth:`Population.encode`."""

    def __init__(self, predictor: AccuracyPredictor, fit: PredictorFit | None = None):
        self.predictor = predictor
        self.fit = fit

    def __call__(self, pop: Population) -> np.ndarray:
        """``(P,)`` float64 predicted accuracy (fraction 0..1)."""
        return self.predictor.predict(pop.encode())

    @classmethod
    def from_measurements(cls, measured: MeasuredAccuracy, n_samples: int, seed: int = 0, *,
                          folds: int = 4, hidden: int = 128, epochs: int = 400,
                          progress: bool = True) -> PredictedAccuracy:
        """Measure ``n_samples`` distinct random archs (always including the smallest and the
        largest) and train the predictor on them (OFA Sec. 3.4); Kendall tau by ``folds``-fold CV.

        Raises:
            UserInputError: ``n_samples < 4``.
        """
        if n_samples < 4:
            raise UserInputError(f"must be >= 4, got {n_samples}", field="search.predictor_samples")
        space = measured.space
        rng = np.random.default_rng(seed)
        archs: dict[str, ArchConfig] = {}
        for a in (space.smallest(), space.largest()):
            archs[a.to_string()] = a
        tries = 0
        while len(archs) < n_samples and tries < 50:
            for a in Population.sample(space, n_samples, rng).archs():
                if len(archs) < n_samples:
                    archs.setdefault(a.to_string(), a)
            tries += 1
        arch_list = list(archs.values())
        acc = measured.measure(arch_list, progress=progress, desc="measuring subnets for the predictor")
        x = Population.from_archs(space, arch_list).encode()
        model, fit = train_predictor(x, acc, folds=folds, hidden=hidden, epochs=epochs, seed=seed)
        return cls(model, fit)


__all__ = ["MeasuredAccuracy", "PredictedAccuracy", "check_eval_data"]
