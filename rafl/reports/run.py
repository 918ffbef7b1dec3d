"""The files of a federated run dir that record its rounds: what :class:`RunReport` writes.

The engine (:class:`rafl.federation.engine.Engine`) produces data only: one record per completed
round (``history``, :class:`~rafl.federation.round_record.RoundRecord` s) and the run summary,
handed to the observers its caller attached (:class:`rafl.federation.engine.RunObserver`).
:class:`RunReport` is the observer that writes them into the run dir:

* after every round, before the round's checkpoint: ``metrics.jsonl`` (one JSON object per
  round, each record's :meth:`~rafl.federation.round_record.RoundRecord.as_row`; what
  ``rafl compare`` reads back) and ``metrics.csv`` (union of the columns), each rewritten
  atomically, so a crash loses no completed round;
* after the last round: both again (with the last round's complete timing), ``summary.json``,
  ``accuracy_vs_round.png`` and ``accuracy_vs_mb.png``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from rafl.federation.algorithms import reported_accuracies
from rafl.federation.round_record import RoundRecord
from rafl.io import atomic_write_json, atomic_write_text
from rafl.reports.plots import new_figure, save_figure

__all__ = ["RunReport", "write_metrics", "plot_metrics"]


class RunReport:
    """The run dir's record of a federated run (a :class:`rafl.federation.engine.RunObserver`).

    Args:
        run_dir: the run dir (exists).
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    def round_done(self, history: list[RoundRecord]) -> None:
        """``metrics.jsonl`` and ``metrics.csv`` with every round so far (:func:`write_metrics`)."""
        write_metrics(self.run_dir, history)

    def run_done(self, history: list[RoundRecord], summary: dict[str, Any]) -> None:
        """The metrics files again, ``summary.json`` and the two accuracy plots (:func:`plot_metrics`)."""
        write_metrics(self.run_dir, history)
        atomic_write_json(self.run_dir / "summary.json", summary)
        plot_metrics(self.run_dir, history, title=f"{summary.get('algorithm', 'run')}, {self.run_dir.name}")


def write_metrics(run_dir: Path, history: list[RoundRecord]) -> None:
    """``metrics.jsonl`` (one JSON object per round: its record's ``as_row()``) and ``metrics.csv``
    (union of columns), atomically."""
    rows = [record.as_row() for record in history]
    atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, restval="")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(run_dir / "metrics.csv", buf.getvalue())


def plot_metrics(run_dir: Path, history: list[RoundRecord], title: str = "") -> None:
    """``accuracy_vs_round.png`` and ``accuracy_vs_mb.png`` (every evaluated model, mean over
    clients with a +-std band), written atomically; nothing when no round was evaluated. Each
    plot's title says what it shows, after ``title`` (the method and run, e.g. ``"rafl, run-1"``)."""
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 - matplotlib: heavy, loaded only when a run plots

    evals = [r for r in history if any(a.acc_mean_over_clients is not None for a in r.accuracies.values())]
    if not evals:
        return
    models = sorted({m for r in evals for m, a in r.accuracies.items() if a.acc_mean_over_clients is not None})
    names = {p: a.name for p, a in reported_accuracies().items()}  # "deployed model", "knowledge network", ...
    for xkey, fname, xlabel in (("round", "accuracy_vs_round.png", "round"),
                                ("cum_mb", "accuracy_vs_mb.png", "cumulative communication (MB, up + down)")):
        fig, (ax,) = new_figure(1, width=5.5, height=3.6)
        what = "client test accuracy by round" if xkey == "round" else "client test accuracy vs communication"
        ax.set_title(f"{title}: {what}" if title else what, fontsize=9)
        for m in models:
            pts = [(getattr(r, xkey), a.acc_mean_over_clients, a.acc_std_over_clients) for r in evals
                   if (a := r.accuracies.get(m)) is not None and a.acc_mean_over_clients is not None]
            x, y, s = (np.array(v, dtype=float) for v in zip(*pts))
            ax.plot(x, y, marker="o", ms=3, label=f"{names.get(m, m)} (mean over clients, band = std)")
            ax.fill_between(x, np.clip(y - s, 0, 1), np.clip(y + s, 0, 1), alpha=0.15)  # accuracy lives in [0, 1]
        ax.set_xlabel(xlabel)
        if xkey == "round":  # rounds are whole numbers: no 1.5 (or 0.96 for one round) ticks on short runs
            rounds = sorted({r.round for r in evals})
            if len(rounds) <= 12:
                ax.set_xticks(rounds)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, run_dir / fname, dpi=110)
