"""Accuracy predictor: a small MLP regressor on the arch encoding (OFA's accuracy predictor).

Once-for-All (Cai et al., ICLR 2020, Sec. 3.4) trains a 3-layer MLP (400 hidden units) on
[arch encoding, measured accuracy] pairs of subnets sampled from the trained supernet, then lets
the evolutionary search query it instead of evaluating subnets. rafl does the same on
:meth:`ArchConfig.encode` / :meth:`rafl.search.genome.Population.encode`, reports the ranking
quality as Kendall's tau on held-out archs (``scipy.stats.kendalltau``), and evaluates a whole
generation in one batched call.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau
from torch import nn

from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (``None``: unchanged), then restore.

    The search's tensors are small (an MLP on ~100 encodings, subnets at 24-32 px): one thread is
    fastest, and on a shared machine extra OpenMP threads make them many times slower.
    """
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


@dataclass(frozen=True)
class PredictorFit:
    """How well a predictor ranks held-out archs.

    Attributes:
        kendall_tau: Kendall's tau-b between predicted and measured accuracy of the held-out
            archs (``nan`` when fewer than 3 were held out or all measured values are equal).
        rmse: root-mean-square error on the held-out archs (accuracy as a fraction 0..1).
        n_train: archs used to fit the probe model scored on the held-out archs (the returned
            model is refit on all ``n_train + n_holdout``).
        n_holdout: archs held out for ``kendall_tau`` / ``rmse``.
    """

    kendall_tau: float
    rmse: float
    n_train: int
    n_holdout: int

    def to_dict(self) -> dict[str, float | int]:
        return {"kendall_tau": self.kendall_tau, "rmse": self.rmse, "n_train": self.n_train,
                "n_holdout": self.n_holdout}


class AccuracyPredictor(nn.Module):
    """MLP ``(N, encoding_size) -> (N,)`` predicted top-1 accuracy (fraction 0..1).

    ``n_layers`` hidden ``Linear + ReLU`` layers of width ``hidden`` and a bias-free output layer
    plus a constant ``base_acc`` (OFA's ``AccuracyPredictor`` layout, ``ofa/nas/accuracy_predictor/
    acc_predictor.py``); targets are standardized internally (``base_acc`` = their mean, ``scale``
    = their standard deviation). Always on CPU, float32.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, n_inputs) float32 encodings -> (N,) predicted accuracy."""
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
        x_t = torch.as_tensor(np.asarray(x, dtype=np.float32))
        y_t = torch.as_tensor(np.asarray(y, dtype=np.float32))
        if x_t.ndim != 2 or x_t.shape[1] != self.n_inputs or y_t.shape != (x_t.shape[0],):
            raise UserInputError(f"expected x (N, {self.n_inputs}) and y (N,), got {tuple(x_t.shape)} "
                                 f"and {tuple(y_t.shape)}", field="predictor.fit")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
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
        """(N, n_inputs) encodings -> (N,) float64 predicted accuracy (numpy in and out, no autograd).

        One batched forward pass in torch (inference mode) for a whole generation.
        """
        with torch.inference_mode(), torch_threads(1):
            out = self.forward(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
        return out.numpy().astype(np.float64)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Save weights + shape as safetensors (atomic)."""
        from safetensors.torch import save

        meta = {"n_inputs": str(self.n_inputs), "hidden": str(self.hidden), "n_layers": str(self.n_layers),
                "extra": json.dumps(extra or {})}
        atomic_write_bytes(path, save({k: v.contiguous() for k, v in self.state_dict().items()}, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> AccuracyPredictor:
        """Inverse of :meth:`save`. Raises UserInputError on a missing or malformed file."""
        from safetensors import safe_open

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
    if len(predicted) < 3 or np.ptp(measured) == 0:
        return float("nan")
    return float(kendalltau(predicted, measured).statistic)


def train_predictor(x: np.ndarray, y: np.ndarray, *, holdout: float = 0.25, hidden: int = 128,
                    n_layers: int = 3, epochs: int = 400, lr: float = 1e-3, seed: int = 0
                    ) -> tuple[AccuracyPredictor, PredictorFit]:
    """Train an :class:`AccuracyPredictor` on measured archs and report its held-out ranking.

    A random ``holdout`` fraction (at least 3 archs when there are >= 8) is held out; the model
    fit on the rest is scored there (Kendall tau, RMSE); the returned model is then refit on all
    archs with the same seed and hyper-parameters (the held-out score estimates its quality).

    Args:
        x: (N, encoding_size) float32 encodings. y: (N,) measured accuracy, fraction 0..1.
    Raises:
        UserInputError: fewer than 2 measured archs.
    """
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        raise UserInputError(f"needs >= 2 measured archs, got {n}", field="search.predictor_samples")
    rng = np.random.default_rng(seed)
    n_hold = int(round(holdout * n)) if n >= 8 else 0
    n_hold = max(n_hold, 3) if n >= 8 and holdout > 0 else n_hold
    perm = rng.permutation(n)
    hold, train = perm[:n_hold], perm[n_hold:]
    tau, rmse = float("nan"), float("nan")
    if n_hold:
        probe = AccuracyPredictor(x.shape[1], hidden, n_layers).fit(x[train], y[train], epochs=epochs, lr=lr, seed=seed)
        pred = probe.predict(x[hold])
        tau = kendall_tau(pred, y[hold])
        rmse = float(np.sqrt(np.mean((pred - y[hold]) ** 2)))
    model = AccuracyPredictor(x.shape[1], hidden, n_layers).fit(x, y, epochs=epochs, lr=lr, seed=seed)
    return model, PredictorFit(kendall_tau=tau, rmse=rmse, n_train=len(train), n_holdout=n_hold)


__all__ = ["AccuracyPredictor", "PredictorFit", "kendall_tau", "train_predictor", "torch_threads"]
