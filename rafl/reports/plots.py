"""Plot helpers shared by every rafl report (matplotlib, headless, atomic PNG writes)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from rafl.io import atomic_write_bytes

__all__ = ["new_figure", "save_figure", "bar_panels", "pyplot"]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed), imported on first use:
    matplotlib is heavy, and a run holds it only once it plots (docs/design.md, "Layers")."""
    import matplotlib  # noqa: PLC0415 - heavy, loaded only when something is plotted

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # noqa: PLC0415 - as above

    return plt


def new_figure(n_panels: int = 1, width: float = 6.0, height: float = 3.2):
    """A matplotlib figure with ``n_panels`` stacked axes (Agg backend: no display needed).

    Returns:
        ``(fig, axes)`` with ``axes`` a list of length ``n_panels``.
    """
    fig, axes = pyplot().subplots(n_panels, 1, figsize=(width, height * n_panels), squeeze=False)
    return fig, [ax for ax in axes[:, 0]]


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Render ``fig`` to PNG and write it atomically to ``path``; closes the figure."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def bar_panels(path: str | Path, categories: Sequence[str], panels: Sequence[tuple[str, Sequence[float]]],
               title: str = "", colors: Sequence[str] | None = None) -> Path:
    """One bar chart per panel, sharing the x categories, written to ``path`` (PNG).

    Args:
        categories: x tick labels.
        panels: ``(y label, values)`` per panel; values align with ``categories``.
        title: figure title.
        colors: one colour per panel (matplotlib default cycle otherwise).
    """
    fig, axes = new_figure(len(panels), width=max(6.0, 0.8 * len(categories)))
    cycle = list(colors) if colors else [f"C{i}" for i in range(len(panels))]
    for ax, (label, values), color in zip(axes, panels, cycle):
        bars = ax.bar(range(len(categories)), values, color=color)
        ax.set_ylabel(label)
        ax.set_xticks(range(len(categories)), list(categories), rotation=0)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if title:
        axes[0].set_title(title)
    return save_figure(fig, path)
