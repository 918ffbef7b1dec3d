"""``rafl compare``'s outputs: one row per method from its run dir (:func:`summarize_run`), the
final-round accuracy per device tier (:func:`tier_accuracy`, :func:`common_client_tiers`), the
comparison table (``compare.md``, ``compare.csv``, ``compare.json``: :func:`write_table`) and its
plots (``compare.png``: :func:`plot_compare`; ``compare_curve.png``: :func:`plot_accuracy_vs_mb`).
Reads run dirs and writes files; runs nothing (:mod:`rafl.stages.compare` runs the methods)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from rafl.errors import UserInputError
from rafl.federation.algorithms import ALGORITHMS, DEPLOYED, Accuracy, reported_accuracies
from rafl.federation.metric_keys import (
    DEPLOYED_MODEL,
    GLOBAL_TEST_SAMPLES,
    MODEL,
    NEW_CLIENTS,
    NEW_CLIENTS_FT,
    TEST_SAMPLES,
    ModelKeys,
    client_accuracies,
)
from rafl.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from rafl.reports.plots import pyplot
from rafl.reports.tables import binomial_se

#: evaluated rounds averaged in the ``acc_mean_last3`` columns
LAST_EVALS = 3


def tier_accuracy(clients: dict[str, dict[str, Any]], table: list[dict[str, Any]], model: str = DEPLOYED_MODEL
                  ) -> dict[str, dict[str, float]]:
    """Final-round test accuracy per device tier (the clients of one device profile).

    Args:
        clients: the engine summary's ``clients`` (``{client id: {"<model>.acc", "test_samples"}}``).
        table: the clients table (one row per client with its ``"client"`` and ``"profile"``).
        model: which model's accuracy (``model`` = the deployed client model).
    Returns:
        ``{profile: {"clients", "test_samples", "acc_mean", "acc_pooled", "se"}}``: ``acc_mean`` is
        the unweighted mean over the tier's clients, ``acc_pooled`` correct / test samples of the
        tier's clients together, ``se`` its binomial standard error ``sqrt(p (1 - p) / n)``, all
        fractions in [0, 1]; clients without test samples are left out; ``{}`` if the table names no
        profiles.
    """
    by: dict[str, list[tuple[float, int]]] = {}
    for row in table:
        if "profile" not in row:
            return {}
        rec = clients.get(str(row["client"]), {})
        acc, n = rec.get(ModelKeys(model).acc), int(rec.get(TEST_SAMPLES, 0) or 0)
        if acc is not None and n > 0:
            by.setdefault(str(row["profile"]), []).append((float(acc), n))
    out = {}
    for prof, vals in by.items():
        n = sum(t for _, t in vals)
        pooled = sum(a * t for a, t in vals) / n
        out[prof] = {"clients": len(vals), "test_samples": n, "acc_mean": float(np.mean([a for a, _ in vals])),
                     "acc_pooled": float(pooled), "se": binomial_se(pooled, n)}
    return out


def tier_global_accuracy(clients: dict[str, dict[str, Any]], table: list[dict[str, Any]],
                         model: str = DEPLOYED_MODEL) -> dict[str, dict[str, float]]:
    """Final-round accuracy on the held-out global test set per device tier and ``"all"``.

    Args:
        clients: the engine summary's ``clients`` (``{id: {"model@global.acc", "global_test_samples"}}``).
        table: the clients table (``"client"``, ``"profile"`` per row; without profiles only ``"all"``).
        model: which model (``model`` = the deployed client model).

    Returns:
        ``{tier: {"clients", "test_samples", "acc_mean", "se"}}``: ``acc_mean`` the mean over the
        tier's clients of their accuracy on the same ``test_samples`` images, ``se`` the binomial
        standard error ``sqrt(p (1 - p) / n)`` of one model scored on them (the images are shared,
        so they are not pooled over clients); ``{}`` when no client was scored on a global test set.
    """
    by: dict[str, list[float]] = {}
    n = 0
    for row in table:
        rec = clients.get(str(row["client"]), {})
        acc = rec.get(ModelKeys(model).on_global.acc)
        if acc is None:
            continue
        n = int(rec.get(GLOBAL_TEST_SAMPLES, 0) or 0)
        for tier in {str(row.get("profile", "all")), "all"}:
            by.setdefault(tier, []).append(float(acc))
    out = {}
    for tier, accs in by.items():
        mean = float(np.mean(accs))
        out[tier] = {"clients": len(accs), "test_samples": n, "acc_mean": mean, "se": binomial_se(mean, n)}
    return out


def common_client_tiers(rows: list[dict[str, Any]], out: Path, table: list[dict[str, Any]]) -> None:
    """Restrict every row's per-tier figures to the clients that every method evaluated one by one.

    A method that shares one evaluation among its never-trained clients (``eval_clients: all``,
    :mod:`rafl.federation.workers`) reports per-client accuracies only for the trained ones; FedGH
    evaluates everyone. So that the tier table compares methods on the same clients, ``tiers`` (and
    ``tiers_overall``: the same figures over all tiers together) are recomputed from each method's
    ``summary.json`` over the intersection, and ``tier_clients`` / ``clients_left_out`` say how many
    clients that is and which were left out. Rows are changed in place.
    """
    summaries = {}
    for r in rows:
        base = r.get("finetuned_from")
        path = out / base / FINETUNED if base else out / r["algorithm"] / "summary.json"
        if r.get("tiers") and path.is_file():
            summaries[r["algorithm"]] = json.loads(path.read_text()).get("clients", {})
    if not summaries:
        return
    common = set.intersection(*(set(c) for c in summaries.values()))
    everyone = {str(row["client"]) for row in table}
    for r in rows:
        clients = summaries.get(r["algorithm"])
        if clients is None:
            continue
        kept = {cid: clients[cid] for cid in common}
        r["tiers"] = tier_accuracy(kept, table)
        held = tier_global_accuracy(kept, table)
        if held:
            r["tiers_global"] = held
        r["tiers_overall"] = tier_accuracy(kept, [{**row, "profile": "all"} for row in table]).get("all", {})
        r["tier_clients"] = len(common)
        r["clients_left_out"] = sorted(everyone - common, key=int)


def summarize_run(name: str, summary: dict[str, Any], history: list[dict], wall_s: float,
                  table: list[dict[str, Any]] | None = None, subnets: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row of the comparison table from an engine summary and its metrics history.

    With the clients ``table`` (NAS clients name their device profile): ``tiers``, the final-round
    accuracy per device tier (:func:`tier_accuracy`); with ``subnets`` (the pipeline's per-profile
    subnets and budgets): ``subnets``. ``mb_up_per_client_round`` / ``mb_down_per_client_round``:
    payload MB per participating client per round (mean over rounds).
    """
    evals = [r for r in history if MODEL.acc_mean_over_clients in r]
    last = evals[-1] if evals else {}
    row: dict[str, Any] = {"algorithm": name}
    if summary.get("bn_statistics"):  # the deployed models' BN statistics rule (train.bn_statistics)
        row["bn_statistics"] = summary["bn_statistics"]
    for base in reported_accuracies():  # every accuracy a method may report: the deployed model's first
        for m in (ModelKeys(base), ModelKeys(base).on_global):
            if m.acc_mean_over_clients in last:
                row[m.acc_mean] = float(last[m.acc_mean_over_clients])
                row[m.acc_std] = float(last.get(m.acc_std_over_clients, float("nan")))
                # all clients' test samples together (HtFLlib's / PFLlib's "Averaged Test Accuracy")
                row[m.acc_pooled] = float(last.get(m.acc_sample_weighted, float("nan")))
                # the mean of the last LAST_EVALS evaluated rounds: one round's figure swings with the
                # round's sampled clients (global models move by +-3 points between rounds)
                tail = [r[m.acc_mean_over_clients] for r in evals[-LAST_EVALS:] if m.acc_mean_over_clients in r]
                row[m.acc_mean_last(LAST_EVALS)] = float(np.mean(tail))
    up = sum(r["bytes_up"] for r in history)
    down = sum(r["bytes_down"] for r in history)
    row.update({"mb_up": up / 1e6, "mb_down": down / 1e6, "mb_total": (up + down) / 1e6,
                "bytes_up_last_round": history[-1]["bytes_up"] if history else 0,
                "rounds": len(history), "wall_s": float(wall_s)})
    failed = int(summary.get("failed_rounds", 0) or 0)
    if failed:  # rounds whose uploads were all refused: the row is not a clean run of the method
        row["failed_rounds"] = failed
        row["failed_round_reasons"] = list(summary.get("failed_round_reasons", []))[:5]
    part = sum(r.get("participated", 0) for r in history)
    row["mb_up_per_client_round"] = up / part / 1e6 if part else 0.0
    row["mb_down_per_client_round"] = down / part / 1e6 if part else 0.0
    if last and MODEL.acc_pooled in row and not math.isnan(row[MODEL.acc_pooled]):
        n = sum(int(c.get(TEST_SAMPLES, 0) or 0) for c in summary.get("clients", {}).values())
        row[MODEL.acc_pooled_se] = binomial_se(row[MODEL.acc_pooled], n)
    tiers = tier_accuracy(summary.get("clients", {}), table or [])
    if tiers:
        row["tiers"] = tiers
    held = tier_global_accuracy(summary.get("clients", {}), table or [])
    if held:
        row["tiers_global"] = held
    if subnets:
        row["subnets"] = {prof: {k: v[k] for k in ("arch", "source", "budgets") if k in v} for prof, v in subnets.items()}
    return row


#: a global-model method's run dir keeps its fine-tuned variant's per-client results here
FINETUNED = "finetuned.json"


def finetuned_clients(per_client: dict[int, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per-client accuracies of a fine-tuned variant in the format of ``summary.json``'s
    ``clients`` (``{"0": {"model.acc", "test_samples", "model@global.acc", "global_test_samples"}}``)."""
    out: dict[str, dict[str, Any]] = {}
    for cid, r in sorted(per_client.items()):
        rec: dict[str, Any] = client_accuracies(r)
        rec[TEST_SAMPLES] = r.get(MODEL.total, 0)
        if MODEL.on_global.total in r:
            rec[GLOBAL_TEST_SAMPLES] = r[MODEL.on_global.total]
        out[str(cid)] = rec
    return out


def summarize_finetuned(base_row: dict[str, Any], clients: dict[str, dict[str, Any]], seconds: float,
                        table: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The row of a global-model method's fine-tuned variant (``<method>-ft``): its accuracies
    from ``clients`` (:func:`finetuned_clients`, all clients, after the last round), its
    communication that of the base method (fine-tuning sends nothing), its wall time the base
    method's plus ``seconds`` of fine-tuning."""
    name = base_row["algorithm"]
    row: dict[str, Any] = {"algorithm": f"{name}-ft", "finetuned_from": name}
    for m, key in ((MODEL, TEST_SAMPLES), (MODEL.on_global, GLOBAL_TEST_SAMPLES)):
        accs = [c[m.acc] for c in clients.values() if c.get(m.acc) is not None]
        if not accs:
            continue
        row[m.acc_mean] = float(np.mean(accs))
        row[m.acc_std] = float(np.std(accs))
        n = [int(c.get(key, 0) or 0) for c in clients.values() if c.get(m.acc) is not None]
        row[m.acc_pooled] = float(np.dot(accs, n) / sum(n)) if sum(n) else float("nan")
    if NEW_CLIENTS_FT.acc_mean in base_row:  # the new-clients protocol's fine-tuned figure is this row's
        row[NEW_CLIENTS.acc_mean] = base_row[NEW_CLIENTS_FT.acc_mean]
    for key in ("mb_up", "mb_down", "mb_total", "bytes_up_last_round", "rounds", "mb_up_per_client_round",
                "mb_down_per_client_round", "subnets", "new_clients", "bn_statistics"):
        if key in base_row:
            row[key] = base_row[key]
    row["wall_s"] = float(base_row.get("wall_s", 0.0)) + float(seconds)
    if MODEL.acc_pooled in row:
        n = sum(int(c.get(TEST_SAMPLES, 0) or 0) for c in clients.values())
        row[MODEL.acc_pooled_se] = binomial_se(row[MODEL.acc_pooled], n)
    tiers = tier_accuracy(clients, table or [])
    if tiers:
        row["tiers"] = tiers
    held = tier_global_accuracy(clients, table or [])
    if held:
        row["tiers_global"] = held
    return row


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run dir's ``metrics.jsonl`` (one per completed round; [] when there is none).

    Raises:
        UserInputError: a line that is not a JSON object (a damaged file), naming the file.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise UserInputError(f"line {i} is not a JSON object (a damaged file); allowed: a metrics.jsonl written "
                                 f"by rafl, or delete {run_dir.name}/ to rerun that method", source=path)
        rows.append(row)
    return rows


_COLS = [("algorithm", "method"), (MODEL.acc_mean, "acc mean"), (MODEL.acc_std, "acc std"),
         (MODEL.acc_pooled, "pooled acc"), (MODEL.acc_mean_last(LAST_EVALS), f"acc mean, last {LAST_EVALS} evals"),
         (MODEL.on_global.acc_mean, "global acc mean"),
         (MODEL.on_global.acc_mean_last(LAST_EVALS), f"global acc mean, last {LAST_EVALS} evals"),
         (NEW_CLIENTS.acc_mean, "new clients acc"), (NEW_CLIENTS_FT.acc_mean, "new clients acc, fine-tuned")]
_COLS_AFTER = [("bn_statistics", "BN statistics"), ("mb_up", "MB up"), ("mb_down", "MB down"), ("mb_total", "MB total"), ("wall_s", "wall s"),
         ("settings", "non-default settings")]


#: decimals per column kind: accuracies 4, MB 3, seconds 1 (one precision per column)
_DECIMALS = {"mb_up": 3, "mb_down": 3, "mb_total": 3, "wall_s": 1}


def _fmt(v: Any, key: str = "") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    if isinstance(v, float):
        decimals = _DECIMALS.get(key, 4)
        if key.startswith("mb_") and v != 0 and math.isfinite(v) and abs(v) < 0.5 * 10.0 ** -decimals:
            # a method that communicated never reads 0.000 (FedProto's prototypes: a few hundred bytes):
            # two significant digits, still in MB, e.g. 0.00044
            decimals = 1 - math.floor(math.log10(abs(v)))
        return f"{v:.{decimals}f}"
    return str(v)


def _flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """A table row for the CSV: ``tiers`` as ``tier.<profile>.<key>`` columns, ``subnets`` as
    ``subnet.<profile>`` (the arch string)."""
    flat = {k: v for k, v in row.items() if k not in ("tiers", "subnets", "tiers_overall", "clients_left_out",
                                                      "tiers_global")}
    for prof, t in (row.get("tiers_global") or {}).items():
        flat.update({f"tier_global.{prof}.{k}": v for k, v in t.items()})
    for k, v in (row.get("tiers_overall") or {}).items():
        flat[f"tier.all.{k}"] = v
    for prof, t in (row.get("tiers") or {}).items():
        flat.update({f"tier.{prof}.{k}": v for k, v in t.items()})
    for prof, v in (row.get("subnets") or {}).items():
        flat[f"subnet.{prof}"] = v.get("arch", "")
    return flat


def tier_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of the per-device-tier tables (NAS comparisons; ``[]`` otherwise): accuracy
    per tier and overall (mean over clients / pooled +- binomial standard error), MB per client per
    round, wall time; then each tier's subnet(s), what they cost and the budget that binds."""
    tiered = [r for r in rows if r.get("tiers")]
    if not tiered:
        return []
    profs = list(dict.fromkeys(p for r in tiered for p in r["tiers"]))

    def acc(t: dict[str, Any] | None) -> str:
        if not t:
            return "-"
        return f"{t['acc_mean']:.4f} / {t['acc_pooled']:.4f} ± {t['se']:.4f}"

    left = tiered[0].get("clients_left_out")
    over = (f" Over the {tiered[0]['tier_clients']} clients every method evaluated one by one (left out: client(s) "
            f"{', '.join(left)}, never trained by some method, whose shared evaluation of the initial model has no "
            "per-client figure)." if left else "")
    lines = ["", "Per device tier (final round; mean over the tier's clients / pooled ± binomial standard "
             "error sqrt(p(1-p)/n) over its test samples; MB = payload per participating client per round)."
             + over, "",
             "| method | " + " | ".join(f"{p} (n)" for p in profs) + " | overall | MB up | MB down | wall s |",
             "|" + "---|" * (len(profs) + 5)]
    for r in tiered:
        t = r["tiers"]
        overall = r.get("tiers_overall") or {"acc_mean": r.get(MODEL.acc_mean, float("nan")),
                                             "acc_pooled": r.get(MODEL.acc_pooled, float("nan")),
                                             "se": r.get(MODEL.acc_pooled_se, float("nan"))}
        cells = [acc(t.get(p)) + (f" ({t[p]['test_samples']})" if p in t else "") for p in profs]
        lines.append(f"| {r['algorithm']} | " + " | ".join(cells) + f" | {acc(overall)} | "
                     f"{_fmt(r.get('mb_up_per_client_round'), 'mb_up')} | {_fmt(r.get('mb_down_per_client_round'), 'mb_down')} | "
                     f"{_fmt(r.get('wall_s'), 'wall_s')} |")
    held = [r for r in tiered if r.get("tiers_global")]
    if held:
        n = next(iter(held[0]["tiers_global"].values()))["test_samples"]
        lines += ["", f"Global protocol: the same deployed models scored on the held-out balanced global test set "
                  f"({n} images no client and no supernet saw; mean over the tier's clients ± binomial standard "
                  "error of one model on those images).", "",
                  "| method | " + " | ".join(profs) + " | overall |", "|" + "---|" * (len(profs) + 2)]
        for r in held:
            g = r["tiers_global"]
            cells = [f"{g[p]['acc_mean']:.4f} ± {g[p]['se']:.4f}" if p in g else "-" for p in [*profs, "all"]]
            lines.append(f"| {r['algorithm']} | " + " | ".join(cells) + " |")
    seen: dict[tuple[str, str], list[str]] = {}
    info: dict[tuple[str, str], dict[str, Any]] = {}
    for r in tiered:
        for prof, v in (r.get("subnets") or {}).items():
            if prof in profs and "budgets" in v:
                seen.setdefault((prof, v["arch"]), []).append(r["algorithm"])
                info[(prof, v["arch"])] = v["budgets"]
    if seen:
        lines += ["", "Each tier's subnet and what it costs on the tier's device (latency: the profile's estimate; "
                  "the binding budget is the one the subnet uses to >= 90%):", "",
                  "| tier | methods | subnet | MACs (M) | latency (ms) | peak memory (MiB) | binding budget | fits |",
                  "|---|---|---|---|---|---|---|---|"]
        for (prof, arch), methods in seen.items():
            b = info[(prof, arch)]
            cell = arch.replace("|", "\\|")  # a pipe inside a table cell, even in backticks, ends the cell
            lines.append(f"| {prof} | {', '.join(methods)} | `{cell}` | {b['macs_m']:.2f} | {b['latency_ms']:.3g} | "
                         f"{b['peak_memory_mb']:.3g} | {b['binding']} | {'yes' if b['fits'] else 'NO'} |")
    return lines


def plot_accuracy_vs_mb(path: Path, histories: dict[str, list[dict[str, Any]]]) -> None:
    """Client test accuracy (mean over clients, every evaluated round) against cumulative MB
    communicated (payload up + down, all clients), one line per method (PNG, atomic); a log MB
    axis when the methods' traffic spans more than 20x. A method that communicates nothing
    (standalone) is a horizontal line at its final accuracy."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    top = max((r.get("cum_mb", 0.0) for h in histories.values() for r in h), default=0.0)
    for name, hist in histories.items():
        pts = [(r.get("cum_mb", 0.0), r[MODEL.acc_mean_over_clients]) for r in hist if MODEL.acc_mean_over_clients in r]
        if not pts:
            continue
        if max(x for x, _ in pts) == 0 and top > 0:
            ax.axhline(pts[-1][1], ls="--", lw=1, color="gray")
            ax.annotate(name, (top, pts[-1][1]), ha="right", va="bottom", fontsize=7, color="gray")
            continue
        ax.plot(*zip(*pts), marker=".", ms=3, lw=1.2, label=name)
    xs = [r["cum_mb"] for h in histories.values() for r in h if r.get("cum_mb", 0) > 0]
    log = bool(xs) and max(xs) / min(xs) > 20  # prototypes (kB) beside whole models (MB): a log axis
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("cumulative MB communicated (payload up + down, all clients)" + (", log scale" if log else ""))
    ax.set_ylabel("client test accuracy (mean over clients)")
    ax.set_title(f"{', '.join(histories)}: client test accuracy vs communication", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def extra_accuracies(rows: list[dict[str, Any]]) -> list[Accuracy]:
    """The accuracies besides the deployed model's that the rows' methods declare
    (:attr:`rafl.federation.algorithms.Algorithm.accuracies`), in the rows' order, once each."""
    found: dict[str, Accuracy] = {}
    for r in rows:
        method = ALGORITHMS.get(r.get("finetuned_from") or r["algorithm"])  # "<name>-ft": its base method's
        for acc in method.accuracies if method is not None else ():
            if acc != DEPLOYED:
                found.setdefault(acc.prefix, acc)
    return list(found.values())


def failed_round_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines naming every method with failed rounds (``failed_rounds`` of its row: rounds
    whose uploads were refused, which changed no state) and the first reason; empty when none."""
    bad = [r for r in rows if r.get("failed_rounds")]
    if not bad:
        return []
    lines = ["", "Failed rounds (the method's rows above are not clean runs):", ""]
    for r in bad:
        why = (r.get("failed_round_reasons") or ["no reason recorded"])[0]
        lines.append(f"- {r['algorithm']}: {r['failed_rounds']} of {r['rounds']} round(s) failed; {why}")
    return lines


def write_table(out: Path, rows: list[dict[str, Any]], models: str) -> None:
    """``compare.md`` (markdown table), ``compare.csv`` and ``compare.json``, atomically."""
    extra = [col for a in extra_accuracies(rows) for m in [ModelKeys(a.prefix)]
             for col in ((m.acc_mean, a.column), (m.on_global.acc_mean, f"global {a.column}"))]
    every = [*_COLS, *extra, *_COLS_AFTER]
    cols = [c for c in every if any(r.get(c[0]) not in (None, "") for r in rows)]
    measured = any(MODEL.acc_mean in r for r in rows)
    protocols = ("Two protocols: personalized = each client's deployed model on its own (label-skewed) test split "
                 "(acc); global = the same models on the held-out balanced global test set (global acc). "
                 if any(MODEL.on_global.acc_mean in r for r in rows) else "")
    if any(NEW_CLIENTS.acc_mean in r for r in rows):
        protocols += ("New clients = clients held out of training (clients.held_out_fraction), each deployed its "
                      "tier's final model (a global-model method's slice; a per-client method's trained client of the "
                      "same tier with the final broadcast) and scored on its own test split, with no training and "
                      "after one local fine-tune (rafl.federation.new_clients). ")
    lines = [(protocols + "Client test accuracy after the last round (mean/std over clients; pooled = correct / test "
              f"samples of all clients together, where a client counts by its test samples), models: {models}; "
              if measured else "No accuracy: no client holds test data (partition.split has no test share, or the "
              f"clients are too small to get a test sample); models: {models}; ")
             + "MB = payload bytes up + down / 1e6."
             + (" BN statistics = where the deployed models' BatchNorm statistics came from (train.bn_statistics or "
                "the method's own rule: client = re-estimated on the client's own training split, server = on the "
                "server's pool, local = FedBN's own BN layers, averaged = averaged like the weights)."
                if any(r.get("bn_statistics") for r in rows) else ""), "",
             "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(k), k) for k, _ in cols) + " |" for r in rows]
    lines += tier_tables(rows)
    lines += failed_round_notes(rows)
    atomic_write_text(out / "compare.md", "\n".join(lines) + "\n")
    flat = [_flat_row(r) for r in rows]
    keys = sorted({k for r in flat for k in r}, key=lambda k: (k != "algorithm", k))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    for r in flat:
        w.writerow({k: r.get(k, "") for k in keys})
    atomic_write_text(out / "compare.csv", buf.getvalue())
    atomic_write_json(out / "compare.json", {"models": models, "rows": rows})


def plot_compare(path: Path, rows: list[dict[str, Any]]) -> None:
    """Bar charts of the table's columns per method (PNG, atomic): accuracy (mean +- std over
    clients, with each other accuracy a method reports as a marker, e.g. the nearest prototype; its legend
    below the plot, outside the axes), MB communicated, and wall time."""
    plt = pyplot()
    names = [r["algorithm"] for r in rows]
    x = np.arange(len(rows))
    # constrained layout: it makes room for the legend placed outside the axes (below the plot)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(max(9, 1.8 * len(rows) + 5), 3.6), layout="constrained")
    mean = np.array([r.get(MODEL.acc_mean, 0) for r in rows], dtype=float)
    std = np.array([r.get(MODEL.acc_std, 0) for r in rows], dtype=float)
    # error bars clipped to the [0, 1] an accuracy lives in
    ax1.bar(x, mean, yerr=np.stack([np.minimum(std, mean), np.minimum(std, 1 - mean)]), capsize=3, color="tab:blue")
    for acc, marker in zip(extra_accuracies(rows), "D^sv<>p*"):  # e.g. FedProto's nearest-prototype accuracy
        key = ModelKeys(acc.prefix).acc_mean
        points = [(xi, r[key]) for xi, r in zip(x, rows) if r.get(key) is not None]
        if points:
            ax1.scatter(*zip(*points), marker=marker, color="black", zorder=3, s=18, label=acc.name)
    if ax1.get_legend_handles_labels()[0]:
        # below the plot, never over a bar (inside the axes it covered whichever bar stood there)
        fig.legend(fontsize=7, loc="outside lower left")
    fig.suptitle(f"rafl compare, {len(rows)} method{'s' if len(rows) != 1 else ''} on one partition: final round",
                 fontsize=10)
    ax1.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_ylabel("client test accuracy")
    ax1.set_ylim(0, 1)
    ax1.set_title("accuracy (mean ± std over clients)")
    mb = np.array([r["mb_total"] for r in rows], dtype=float)
    positive = mb[mb > 0]
    # the methods' traffic spans orders of magnitude (prototypes: kB; whole models: MB): a log axis
    # then, so the small bars stay visible; every bar carries its value (0 for Standalone)
    log = len(positive) > 1 and positive.max() / positive.min() > 20
    low = positive.min() / 3 if log else 0.0
    ax2.bar(x, np.where(mb > 0, mb, low) if log else mb, color="tab:orange")
    if log:
        ax2.set_yscale("log")
        ax2.set_ylim(low, positive.max() * 4)
    elif mb.max() > 0:
        ax2.set_ylim(0, mb.max() * 1.15)  # headroom: the tallest bar's value label stays clear of the title
    for xi, v in zip(x, mb):
        ax2.annotate(f"{v:.3g}", (xi, max(v, low)), ha="center", va="bottom", fontsize=7,
                     xytext=(0, 2), textcoords="offset points")
    ax2.set_xticks(x, names, rotation=30, ha="right")
    ax2.set_ylabel("MB (up + down)" + (", log scale" if log else ""))
    ax2.set_title("communication")
    wall = np.array([r.get("wall_s", 0.0) for r in rows], dtype=float)
    ax3.bar(x, wall, color="tab:gray")
    if wall.max() > 0:
        ax3.set_ylim(0, wall.max() * 1.15)
    for xi, v in zip(x, wall):
        ax3.annotate(f"{v:.3g}", (xi, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax3.set_xticks(x, names, rotation=30, ha="right")
    ax3.set_ylabel("wall time (s)")
    ax3.set_title("wall time")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


__all__ = ["common_client_tiers", "plot_accuracy_vs_mb", "plot_compare", "read_history", "summarize_run",
           "tier_accuracy", "tier_global_accuracy", "tier_tables", "write_table", "LAST_EVALS", "FINETUNED",
           "finetuned_clients", "summarize_finetuned"]
