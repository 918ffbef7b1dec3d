"""Accuracy predictor: a small MLP regressor on the arch encoding (OFA's accuracy predictor).

Once-for-All (Cai et al., ICLR 2020, Sec. 3.4) trains a 3-layer MLP (400 hidden units) on
[arch encoding, measured accuracy] pairs of subnets sampled from the trained supernet, then lets
the evolutionary search query it instead of evaluating subnets. rafl does the same on
:meth:`ArchConfig.encode` / :meth:`rafl.search.genome.Population.encode`, reports the ranking
quality as Kendall's tau of k-fold out-of-fold predictions (``scipy.stats.kendalltau``), and evaluates a whole
generation in one batched call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors
from torch import nn

from rafl import seeds
from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes
from rafl.threads import torch_threads


@dataclass(frozen=True)
class PredictorFit:
    """How well a predictor ranks archs it was not trained on (k-fold cross-validation).

    Attributes:
        kendall_tau: Kendall's tau-b between the out-of-fold predictions and the measured accuracy,
            pooled over all ``n_holdout`` archs (``nan`` if undefined: < 3 archs or all equal).
        rmse: root-mean-square error of the out-of-fold predictions (accuracy as a fraction 0..1).
        n_train: archs each fold's model was trained on (about ``n_holdout * (folds - 1) / folds``).
        n_holdout: archs with an out-of-fold prediction (all measured archs; 0 without CV).
        folds: number of folds (0: no cross-validation).
    The returned predictor itself is refit on all measured archs.
    """

    kendall_tau: float
    rmse: float
    n_train: int
    n_holdout: int
    folds: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return {"kendall_tau": self.kendall_tau, "rmse": self.rmse, "n_train": self.n_train,
                "n_holdout": self.n_holdout, "folds": self.folds}


#: predictions are rounded to this many decimals (a grid of 1e-6 in accuracy, a fraction 0..1; a
#: measurement on 5,000 images moves in steps of 2e-4): two machines whose float64 arithmetic
#: differs in the last bits give the same value
PREDICTION_DECIMALS = 6


class AccuracyPredictor(nn.Module):
    """MLP ``(N, encoding_size) -> (N,)`` predicted top-1 accuracy (fraction 0..1).

    ``n_layers`` hidden ``Linear + ReLU`` layers of width ``hidden`` and a bias-free output layer
    plus a constant ``base_acc`` (OFA's ``AccuracyPredictor`` layout, ``ofa/nas/accuracy_predictor/
    acc_predictor.py``); targets are standardized internally (``base_acc`` = their mean, ``scale``
    = their standard deviation). Always on CPU, **float64**, and :meth:`predict` rounds to
    ``PREDICTION_DECIMALS`` decimals: the search ranks thousands of subnets whose predictions differ in
    the fourth decimal, so the predictor must give the same numbers on every CPU. In float32 the
    400 full-batch Adam steps of :meth:`fit` amplify the last-bit differences between CPU kernels
    (AVX-512 vs AVX2 matmuls) into different rankings and different picks; in float64 they stay
    around 1e-12, far below the rounding grid.
    """

    def __init__(self, n_inputs: int, hidden: int = 128, n_layers: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(n_layers):
            layers += [nn.Linear(n_inputs if i == 0 else hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden if n_layers else n_inputs, 1, bias=False))
        self.layers = nn.Sequential(*layers)
        self.register_buffer("base_acc", torch.zeros(()))
        self.register_buffer("scale", torch.ones(()))
        self.n_inputs, self.hidden, self.n_layers = n_inputs, hidden, n_layers
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, n_inputs) encodings (cast to float64) -> (N,) float64 predicted accuracy (unrounded)."""
        x = x.to(torch.float64)
        return self.layers(x).squeeze(-1) * self.scale + self.base_acc

    # ------------------------------------------------------------------ training
    def fit(self, x: np.ndarray, y: np.ndarray, *, epochs: int = 400, lr: float = 1e-3,
            weight_decay: float = 1e-4, seed: int = 0) -> AccuracyPredictor:
        """Fit by full-batch Adam on the mean squared error of standardized targets.

        Args:
            x: (N, n_inputs) encodings. y: (N,) measured accuracy (fraction 0..1).
            seed: seeds the weight initialization (the global torch RNG is left untouched).
        Returns self (in eval mode).
        """
        x_t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        y_t = torch.as_tensor(np.asarray(y, dtype=np.float64))
        if x_t.ndim != 2 or x_t.shape[1] != self.n_inputs or y_t.shape != (x_t.shape[0],):
            raise UserInputError(f"expected x (N, {self.n_inputs}) and y (N,), got {tuple(x_t.shape)} "
                                 f"and {tuple(y_t.shape)}", field="predictor.fit")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds.int_seed("predictor-init", seed))
            for m in self.layers:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        base = y_t.mean()
        scale = y_t.std(unbiased=False).clamp_min(1e-4) if len(y_t) > 1 else torch.tensor(1.0)
        self.base_acc.copy_(base)
        self.scale.copy_(scale)
        target = (y_t - base) / scale
        opt = torch.optim.Adam(self.layers.parameters(), lr=lr, weight_decay=weight_decay)
        self.train()
        with torch_threads(1):
            for _ in range(epochs):
                opt.zero_grad(set_to_none=True)
                loss = torch.mean((self.layers(x_t).squeeze(-1) - target) ** 2)
                loss.backward()
                opt.step()
        self.eval()
        return self

    # ------------------------------------------------------------------ inference
    def predict(self, x: np.ndarray) -> np.ndarray:
        """(N, n_inputs) encodings -> (N,) float64 predicted accuracy, rounded to
        ``PREDICTION_DECIMALS`` decimals (numpy in and out, no autograd).

        Runs the MLP in numpy float64 (one matmul per layer for a whole generation; well under a
        millisecond for 100 archs, less than a torch call's overhead); equal to :meth:`forward` up
        to float rounding and the grid. The numpy copy of the weights is refreshed whenever a
        parameter changed.
        """
        linears = [m for m in self.layers if isinstance(m, nn.Linear)]
        stamp = tuple((id(p), p._version) for m in linears for p in m.parameters())
        if getattr(self, "_np_stamp", None) != stamp:
            self._np_weights = [(m.weight.detach().numpy().T.copy(),
                                 None if m.bias is None else m.bias.detach().numpy().copy()) for m in linears]
            self._np_stamp = stamp
        h = np.asarray(x, dtype=np.float64)
        last = len(self._np_weights) - 1
        for i, (w, b) in enumerate(self._np_weights):
            h = h @ w
            if b is not None:
                h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
        return np.round(h[:, 0] * float(self.scale) + float(self.base_acc), PREDICTION_DECIMALS)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Save weights + shape as safetensors (atomic)."""
        meta = {"n_inputs": str(self.n_inputs), "hidden": str(self.hidden), "n_layers": str(self.n_layers),
                "extra": json.dumps(extra or {})}
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        atomic_write_bytes(path, save_safetensors(state, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> AccuracyPredictor:
        """Inverse of :meth:`save`. Raises UserInputError on a missing or malformed file."""
        path = Path(path)
        if not path.is_file():
            raise UserInputError("no such predictor file", source=path)
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            model = cls(int(meta["n_inputs"]), int(meta["hidden"]), int(meta["n_layers"]))
            model.load_state_dict(tensors)
        except (KeyError, ValueError, RuntimeError, OSError) as err:
            raise UserInputError(f"not a rafl accuracy predictor ({err.__class__.__name__})",
                                 source=path) from None
        return model.eval()


def kendall_tau(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Kendall's tau-b rank correlation (scipy.stats.kendalltau); ``nan`` if undefined."""
    from scipy.stats import kendalltau  # noqa: PLC0415 - scipy.stats: heavy (~60 MB resident), loaded only for tau

    if len(predicted) < 3 or np.ptp(measured) == 0:
        return float("nan")
    return float(kendalltau(predicted, measured).statistic)


def tau_meaning(tau: float) -> str:
    """What a cross-validated Kendall tau says about the predictor's ranking, in a few words.

    Kendall's tau is the share of concordant minus discordant pairs of subnets (1 = the predicted
    order is the measured one, 0 = unrelated). OFA-style predictors reach 0.7-0.9 on ImageNet;
    below ~0.5 the evolution largely optimizes noise and only the re-measured top-k protects
    the pick.
    """
    if math.isnan(tau):
        return "undefined (too few or identical measurements)"
    if tau >= 0.7:
        return "ranks well (>= 0.7)"
    if tau >= 0.5:
        return "ranks fairly (0.5-0.7)"
    return "ranks poorly (< 0.5: the search relies on re-measuring its finalists)"


def train_predictor(x: np.ndarray, y: np.ndarray, *, folds: int = 4, hidden: int = 128, n_layers: int = 3,
                    epochs: int = 400, lr: float = 1e-3, seed: int = 0) -> tuple[AccuracyPredictor, PredictorFit]:
    """Train an :class:`AccuracyPredictor` on measured archs and report how it ranks unseen ones.

    ``folds``-fold cross-validation (random folds from ``seed``): every arch gets a prediction
    from the model trained on the other folds; Kendall's tau and the RMSE are computed over all
    these out-of-fold predictions (more stable than one small held-out set). The returned model
    is then fit on all archs with the same seed and hyper-parameters.

    Args:
        x: (N, encoding_size) encodings (trained on in float64). y: (N,) measured accuracy, fraction 0..1.
        folds: >= 2 for cross-validation, 0 or 1 to skip it (then tau is nan).
    Raises:
        UserInputError: fewer than 2 measured archs.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        raise UserInputError(f"needs >= 2 measured archs, got {n}", field="search.predictor_samples")
    folds = min(int(folds), n) if folds >= 2 else 0
    tau, rmse, n_train = float("nan"), float("nan"), n
    if folds:
        perm = seeds.generator("predictor-folds", seed).permutation(n)
        oof = np.empty(n)
        for f in range(folds):
            test = perm[f::folds]
            train = np.setdiff1d(perm, test)
            probe = AccuracyPredictor(x.shape[1], hidden, n_layers).fit(x[train], y[train], epochs=epochs,
                                                                        lr=lr, seed=seed)
            oof[test] = probe.predict(x[test])
        tau = kendall_tau(oof, y)
        rmse = float(np.sqrt(np.mean((oof - y) ** 2)))
        n_train = n - int(np.ceil(n / folds))
    model = AccuracyPredictor(x.shape[1], hidden, n_layers).fit(x, y, epochs=epochs, lr=lr, seed=seed)
    return model, PredictorFit(kendall_tau=tau, rmse=rmse, n_train=n_train, n_holdout=n if folds else 0,
                               folds=folds)


__all__ = ["PREDICTION_DECIMALS", "AccuracyPredictor", "PredictorFit", "kendall_tau", "tau_meaning", "torch_threads", "train_predictor"]
