"""Per-client partition summary: table rows, a rich table, and the clients-by-classes heat map."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from rafl.data.partition import Partition
from rafl.io import atomic_write_bytes


def client_rows(part: Partition, labels: np.ndarray, n_classes: int) -> list[dict]:
    """One dict per client: client, train, val, test, total (samples), n_classes, classes (held class ids)."""
    counts = part.class_counts(labels, n_classes)
    rows = []
    for cid, c in enumerate(part.clients):
        held = np.flatnonzero(counts[cid]).tolist()
        rows.append({"client": cid, "train": len(c.train), "val": len(c.val), "test": len(c.test),
                     "total": c.n_samples, "n_classes": len(held), "classes": held})
    return rows


def _classes_text(held: list[int], classes: list[str], width: int = 40) -> str:
    text = " ".join(classes[i] for i in held)
    return text if len(text) <= width else text[: width - 3] + "..."


def print_partition_table(part: Partition, labels: np.ndarray, classes: list[str], max_rows: int = 100,
                          console=None) -> list[dict]:
    """Print the per-client table (samples per split, classes held) with rich; returns the rows."""
    console = console or Console()
    rows = client_rows(part, labels, len(classes))
    meta = part.meta
    params = ", ".join(f"{k}={v}" for k, v in meta.get("params", {}).items())
    title = (f"{meta.get('dataset')}: {meta.get('scheme')}{f' ({params})' if params else ''}, "
             f"{len(rows)} clients, seed {meta.get('seed')}")
    table = Table(title=title)
    for col in ("client", "train", "val", "test", "total", "classes"):
        table.add_column(col, justify="left" if col == "classes" else "right")
    table.add_column("held", justify="left")
    shown = rows if len(rows) <= max_rows else rows[: max_rows - 1]
    for r in shown:
        table.add_row(str(r["client"]), str(r["train"]), str(r["val"]), str(r["test"]), str(r["total"]),
                      str(r["n_classes"]), _classes_text(r["classes"], classes))
    if len(shown) < len(rows):
        table.add_row("...", "", "", "", "", "", f"{len(rows) - len(shown)} more clients in partition.json")
    tot = {k: sum(r[k] for r in rows) for k in ("train", "val", "test", "total")}
    table.add_row("all", str(tot["train"]), str(tot["val"]), str(tot["test"]), str(tot["total"]), "", "",
                  end_section=True)
    console.print(table)
    sizes = np.array([r["total"] for r in rows])
    console.print(f"clients: {len(rows)}  samples/client: min {sizes.min()}, median {int(np.median(sizes))}, "
                  f"max {sizes.max()}  public pool: {len(part.public)}  unassigned: {meta.get('unassigned', 0)}")
    return rows


def plot_class_heatmap(counts: np.ndarray, classes: list[str], path: str | Path, title: str = "") -> None:
    """Write a clients (rows) x classes (columns) heat map of sample counts as a PNG, atomically.

    Args:
        counts: int (n_clients, n_classes) samples per client and class.
        classes: class names (column labels when there are at most 30).
        path: the PNG file.
    """
    # matplotlib: heavy, and its backend is chosen (Agg: no display) before pyplot loads, not as a side
    # effect of importing this module
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    n_clients, n_classes = counts.shape
    fig_w = min(16, 3 + 0.35 * n_classes)
    fig_h = min(16, 2 + 0.3 * n_clients)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=100)
    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if n_classes <= 30:
        ax.set_xticks(range(n_classes), labels=classes, rotation=90 if max(map(len, classes)) > 2 else 0)
    if n_clients <= 40:
        ax.set_yticks(range(n_clients))
    if n_clients * n_classes <= 400:
        hi = counts.max() if counts.size else 0
        for i in range(n_clients):
            for j in range(n_classes):
                if counts[i, j]:
                    ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7,
                            color="black" if counts[i, j] > 0.6 * hi else "white")
    fig.colorbar(im, ax=ax, label="samples")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
