"""Pareto fronts of the search: accuracy (maximized) against a cost (minimized).

An arch is on the front when no other evaluated arch is at least as accurate *and* at most as
costly with one of the two strictly better (Pareto optimality; the accuracy-vs-latency and
accuracy-vs-MACs trade-off curves of OFA, Cai et al. 2020, Fig. 1 / Fig. 9).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from rafl.io import atomic_write_bytes, atomic_write_json


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display), imported on first use: only the plots need it."""
    import matplotlib  # noqa: PLC0415 - heavy (~0.5 s), loaded only when a search plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - as above

    return plt


def pareto_front(accuracy: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the Pareto-optimal points, sorted by increasing cost.

    Args:
        accuracy: (N,) higher is better. cost: (N,) lower is better.
    Returns:
        (K,) int64 indices; of several identical (cost, accuracy) points only the first is kept.
    """
    accuracy = np.asarray(accuracy, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    if accuracy.shape != cost.shape or accuracy.ndim != 1:
        raise ValueError(f"accuracy {accuracy.shape} and cost {cost.shape} must be equal 1-d shapes")
    # by cost ascending, then accuracy descending: a point is optimal iff it beats every cheaper one
    order = np.lexsort((-accuracy, cost))
    keep, best = [], -np.inf
    for i in order:
        if accuracy[i] > best:
            keep.append(i)
            best = accuracy[i]
    return np.asarray(keep, dtype=np.int64)


def front_records(accuracy: np.ndarray, costs: dict[str, np.ndarray], arch_strings, cost_key: str
                  ) -> list[dict[str, Any]]:
    """The front for ``cost_key`` as JSON-safe records ``{"arch", "accuracy", <every cost key>}``.

    ``arch_strings`` is a sequence or a callable ``index -> str`` (only front members are named).
    """
    idx = pareto_front(accuracy, costs[cost_key])
    name = arch_strings if callable(arch_strings) else arch_strings.__getitem__
    return [{"arch": name(int(i)), "accuracy": float(accuracy[i]),
             **{k: float(v[i]) for k, v in costs.items()}} for i in idx]


def save_fronts(directory: str | Path, accuracy: np.ndarray, costs: dict[str, np.ndarray], arch_strings,
                *, chosen: dict[str, Any] | None = None, budgets: dict[str, float] | None = None,
                accuracy_source: str = "predictor", title: str = "") -> dict[str, Any]:
    """Write ``pareto.json`` and ``pareto.png`` (accuracy vs ``latency_ms`` and vs ``macs_m``).

    Args:
        directory: output folder. accuracy: (N,) estimated accuracy (fraction 0..1) of every
            distinct evaluated arch. costs: ``{key: (N,)}`` with at least ``latency_ms``/``macs_m``.
        arch_strings: sequence or callable ``index -> arch string``.
        chosen: the selected subnet's ``{"accuracy", "latency_ms", "macs_m", ...}`` (marked).
        budgets: ``{key: limit}`` drawn as vertical lines where they apply.
        accuracy_source: what ``accuracy`` is (``"predictor"`` or ``"measured"``), recorded.
    Returns the JSON document written.
    """
    plt = _pyplot()
    directory = Path(directory)
    axes_keys = [k for k in ("latency_ms", "macs_m") if k in costs]
    doc: dict[str, Any] = {"accuracy_source": accuracy_source, "n_evaluated": int(len(accuracy)),
                           "macs_unit": "millions of multiply-accumulates (1 MAC = 2 FLOPs)"}
    for key in axes_keys:
        doc[f"accuracy_vs_{key}"] = front_records(accuracy, costs, arch_strings, key)
    if chosen is not None:
        doc["chosen"] = chosen
    atomic_write_json(directory / "pareto.json", doc)

    fig, axs = plt.subplots(1, len(axes_keys), figsize=(5.2 * len(axes_keys), 4), squeeze=False)
    labels = {"latency_ms": "latency (ms / image)", "macs_m": "MACs (millions)"}
    for ax, key in zip(axs[0], axes_keys):
        ax.scatter(costs[key], accuracy, s=4, alpha=0.25, color="tab:gray", label="evaluated (feasible)")
        front = doc[f"accuracy_vs_{key}"]
        ax.step([r[key] for r in front], [r["accuracy"] for r in front], where="post", color="tab:blue",
                marker="o", ms=3, label="Pareto front")
        if budgets and key in budgets:
            ax.axvline(budgets[key], color="tab:red", ls="--", lw=1, label=f"budget {budgets[key]:g}")
        if chosen is not None and key in chosen:
            ax.scatter([chosen[key]], [chosen.get("estimated_accuracy", chosen["accuracy"])], marker="*",
                       s=160, color="tab:orange", zorder=5, label="chosen subnet")
        ax.set_xlabel(labels.get(key, key))
        ax.set_ylabel(f"accuracy ({accuracy_source})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(directory / "pareto.png", buf.getvalue())
    return doc


def save_picks_plot(path: str | Path, picks: dict[str, dict[str, Any]], title: str = "") -> None:
    """One accuracy-vs-latency picture of every profile's pick, each profile's latency budget a line.

    Args:
        path: the PNG to write (atomically).
        picks: ``{profile: {"latency_ms", "accuracy" (measured), "predicted_accuracy" (or None),
            "latency_budget_ms" (or None), "arch"}}``; latency is the pick's predicted latency on
            that profile's device (ms per image, batch 1).
        title: the figure title.

    The axes are zoomed to the picks and the budgets near them; a budget off the scale (beyond
    1.5x the largest or below 0.5x the smallest pick latency) is drawn as an arrow at the edge,
    labelled with its value. Measured accuracy is a filled marker, predicted a hollow one, joined
    by a thin line.
    """
    plt = _pyplot()
    names = list(picks)
    lat = np.array([float(picks[n]["latency_ms"]) for n in names])
    acc = np.array([float(picks[n]["accuracy"]) for n in names])
    pred = np.array([np.nan if picks[n].get("predicted_accuracy") is None else float(picks[n]["predicted_accuracy"])
                     for n in names])
    budgets = {n: picks[n].get("latency_budget_ms") for n in names}
    lo_keep, hi_keep = 0.5 * lat.min(), 1.5 * lat.max()
    on = {n: b for n, b in budgets.items() if b is not None and lo_keep <= b <= hi_keep}
    xs = np.concatenate([lat, np.array(list(on.values()), dtype=float)])
    span = max(xs.max() - xs.min(), 0.05 * xs.max())
    x0, x1 = xs.min() - 0.12 * span, xs.max() + 0.12 * span
    ys = np.concatenate([acc, pred[~np.isnan(pred)]])
    yspan = max(ys.max() - ys.min(), 0.01)
    y0, y1 = ys.min() - 0.25 * yspan, ys.max() + 0.25 * yspan
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(names):
        c = colors[i % len(colors)]
        ax.scatter([lat[i]], [acc[i]], s=70, color=c, zorder=4, label=f"{n}: measured")
        if not np.isnan(pred[i]):
            ax.scatter([lat[i]], [pred[i]], s=70, facecolors="none", edgecolors=c, zorder=4,
                       label=f"{n}: predicted")
            ax.plot([lat[i], lat[i]], [acc[i], pred[i]], color=c, lw=0.8, zorder=3)
        b = budgets[n]
        if b is None:
            continue
        if n in on:
            ax.axvline(b, color=c, ls="--", lw=1.2)
            ax.annotate(f"{n} budget {b:g} ms", (b, y1), xytext=(2, -4), textcoords="offset points", rotation=90,
                        va="top", ha="left", fontsize=7, color=c)
        else:
            edge = x1 if b > hi_keep else x0
            direction = 1 if b > hi_keep else -1
            y = y0 + (0.1 + 0.1 * i) * (y1 - y0)
            ax.annotate(f"{n} budget {b:g} ms", xy=(edge, y), xytext=(edge - direction * 0.18 * (x1 - x0), y),
                        arrowprops={"arrowstyle": "->", "color": c}, fontsize=7, color=c, va="center",
                        ha="right" if direction > 0 else "left")
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_xlabel("predicted latency on the profile's device (ms / image, batch 1)")
    ax.set_ylabel("top-1 accuracy on server-val")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2, framealpha=0.8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


__all__ = ["pareto_front", "front_records", "save_fronts", "save_picks_plot"]
