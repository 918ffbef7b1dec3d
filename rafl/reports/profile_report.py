"""Profiling report of one subnet on one device: Markdown + JSON + PNG.

:func:`write_profile_report` is what ``rafl profile`` and ``rafl search`` (for every subnet it
finds) call. The report has

* a per-layer table (one row per OFA layer: name, type, output shape, MACs by fvcore, MACs by
  thop, the cost model's conv + linear MACs, params, output activation MB, predicted device
  latency ms) and its totals;
* the cost model's summary (MACs and FLOPs = 2 x MACs, params, peak inference memory, training
  memory at batch B, predicted device latency and energy, energy per local epoch);
* measured latency on this host (warm-up, then median and p90 over repeats; batch 1 and batch B);
* every budget of the profile with pass/fail and its margin;
* why fvcore and thop differ (what each one counts), with the numbers of this subnet;
* ``<stem>.png``: bar charts of MACs, predicted latency and activation memory per stage, and every
  budget as the share of its limit used.
"""

from __future__ import annotations

import math
import platform
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rafl import seeds
from rafl.io import atomic_write_json, atomic_write_text
from rafl.reports.plots import new_figure, save_figure
from rafl.reports.tables import fmt, markdown_table
from rafl.search.cost import CostModel, check_budgets, energy_per_epoch_j
from rafl.search.counting import count_fvcore, count_thop
from rafl.search.latency import measure_latency_ms
from rafl.search.profile import DeviceProfile, load_profile
from rafl.supernet import extract_subnet, subnet_from_arch
from rafl.supernet.arch import ArchConfig, SearchSpace

__all__ = ["write_profile_report", "count_fvcore", "count_thop", "measure_host_latency", "stage_of", "fmt_cost"]

MIB = 2**20


def _thop_of(tree: dict[str, Any], dotted: str) -> float:
    node: Any = (0.0, 0.0, tree)
    for part in dotted.split("."):
        children = node[2]
        if part not in children:
            return float("nan")
        node = children[part]
    return float(node[0])


def measure_host_latency(model: nn.Module, x: torch.Tensor, *, warmup: int = 5, repeats: int = 20) -> dict[str, float]:
    """Wall-clock latency of ``model(x)`` on this host in inference mode.

    Returns:
        ``{"median_ms", "p90_ms", "min_ms", "repeats", "warmup", "batch_size", "threads"}``.
    """
    times = sorted(measure_latency_ms(model, x, warmup=warmup, repeats=repeats))
    p90 = times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
    return {"median_ms": statistics.median(times), "p90_ms": p90, "min_ms": times[0], "repeats": repeats,
            "warmup": warmup, "batch_size": int(x.shape[0]), "threads": torch.get_num_threads()}


def stage_of(name: str, space: SearchSpace, arch: ArchConfig) -> str:
    """Stage label of a unit for the per-stage chart: ``stem`` (first conv + first block),
    ``stage1``..``stageN`` (the elastic stages) or ``head`` (final expand, feature mix, classifier)."""
    if name in ("first_conv", "blocks.0"):
        return "stem"
    if name.startswith("blocks."):
        n = int(name.split(".")[1]) - 1  # position among the active elastic blocks
        for s, d in enumerate(arch.d):
            if n < d:
                return f"stage{s + 1}"
            n -= d
    return "head"


def _build_model(arch: ArchConfig, space: SearchSpace, model: nn.Module | None, supernet: nn.Module | None) -> nn.Module:
    if model is not None:
        return model.eval()

    if supernet is not None:
        return extract_subnet(supernet, arch).eval()
    torch.manual_seed(seeds.int_seed("profile-weights"))
    return subnet_from_arch(space, arch).eval()  # random weights: costs do not depend on them


def write_profile_report(arch: ArchConfig, profile: DeviceProfile | str | Path, out_dir: str | Path, *,
                         space: SearchSpace | None = None, model: nn.Module | None = None,
                         supernet: nn.Module | None = None, batch_size: int | None = None,
                         measure: bool = True, warmup: int = 5, repeats: int = 20,
                         stem: str = "cost_report") -> dict[str, Any]:
    """Write ``<stem>.md``, ``<stem>.json`` and ``<stem>.png`` for ``arch`` on ``profile`` into ``out_dir``.

    Args:
        arch: the subnet (validated against ``space``).
        profile: a :class:`DeviceProfile`, shipped name or path.
        out_dir: folder (created if missing); each file is written atomically.
        space: the search space (default: ``model.space`` / ``supernet.space``, else the
            default :class:`SearchSpace`).
        model: the subnet module (e.g. loaded weights); else extracted from ``supernet``; else a
            freshly initialised subnet of the same shape (costs and latency do not depend on weights).
        batch_size: the "batch B" of the host measurement and of training memory (default: the
            profile's ``batch_size``).
        measure: time the subnet on this host (batch 1 and batch B).
        warmup, repeats: host timing settings.
        stem: file name stem.

    Returns:
        the JSON document that was written.

    Raises:
        UserInputError: ``arch`` outside ``space``, or a bad profile.
    """
    profile = load_profile(profile) if isinstance(profile, (str, Path)) else profile
    space = space or getattr(model, "space", None) or getattr(supernet, "space", None) or SearchSpace()
    arch = arch.validate(space)
    out_dir = Path(out_dir)
    cm = CostModel(space, profile, batch_size=batch_size)
    b = cm.batch_size
    cost = cm.cost(arch)
    units = cm.units(arch)
    net = _build_model(arch, space, model, supernet)
    x1 = torch.randn(1, 3, arch.r, arch.r)
    per_module, per_op = count_fvcore(net, x1)
    thop_total, thop_tree = count_thop(net, x1)

    rows, layer_docs = [], []
    for u in units:
        spec, name = u["spec"], u["name"]
        fv_ops = per_module.get(name, {})
        fv_total = float(sum(fv_ops.values()))
        th = _thop_of(thop_tree, name)
        shape = (1, spec.cout, spec.hout, spec.hout) if spec.kind != "linear" else (1, spec.cout)
        act_mb = spec.out_elements() * 4 / MIB
        rows.append([name, spec.describe(), "x".join(str(s) for s in shape), fv_total / 1e6, th / 1e6,
                     u["macs"] / 1e6, u["params"], act_mb, u["latency_ms"]])
        layer_docs.append({"name": name, "type": spec.describe(), "key": spec.key, "output_shape": list(shape),
                           "macs_fvcore": fv_total, "macs_fvcore_by_op": fv_ops, "macs_thop": th,
                           "macs_conv_linear": u["macs"], "params": u["params"], "activation_mb": act_mb,
                           "latency_ms": u["latency_ms"], "energy_mj": u["energy_mj"],
                           "stage": stage_of(name, space, arch)})
    fv_sum = sum(r[3] for r in rows)
    rows.append(["**total**", "", "", fv_sum, thop_total / 1e6, cost.macs_m, sum(u["params"] for u in units),
                 sum(r[7] for r in rows), sum(u["latency_ms"] for u in units)])

    host: dict[str, Any] = {}
    if measure:
        host = {"batch_1": measure_host_latency(net, x1, warmup=warmup, repeats=repeats),
                f"batch_{b}": measure_host_latency(net, torch.randn(b, 3, arch.r, arch.r), warmup=max(1, warmup // 2),
                                                   repeats=max(3, repeats // 2)),
                "host": f"{platform.machine()} {platform.processor() or ''}".strip()}

    checks = check_budgets(cost, profile)
    conv_lin = (per_op.get("conv", 0) + per_op.get("linear", 0) + per_op.get("addmm", 0)) / 1e6
    fv_other = {k: v / 1e6 for k, v in per_op.items() if k not in ("conv", "linear", "addmm")}
    thop_extra = thop_total / 1e6 - conv_lin
    why = (
        f"Both tools count one multiply-add as one op for convolutions and linear layers: "
        f"{conv_lin:.4g} M here, equal to the cost model's {cost.macs_m:.4g} M (conv + linear MACs; "
        f"FLOPs = 2 x MACs = {cost.flops_m:.4g} M). They differ in what else they count. "
        f"**fvcore** traces the graph with torch.jit and counts the ATen ops it has handles for: "
        + (", ".join(f"{k} {v:.4g} M" for k, v in sorted(fv_other.items())) or "nothing else")
        + " (batch_norm in eval: 1 op per element, 2 with affine weights; elementwise ops such as "
        "activations, the SE gating multiply, residual adds and the mean pooling are skipped). "
        "**thop** hooks nn.Module classes only: it adds BatchNorm2d as 2 ops per element, x 2 with "
        "affine weights "
        f"({thop_extra:.4g} M over conv + linear here), counts nn.ReLU as 0, and cannot see ofa's "
        "custom Hswish/Hsigmoid modules nor functional ops (mean pooling, SE gating, residual adds). "
        "Budgets use the conv + linear MACs."
    )
    doc = {
        "arch": arch.to_dict(), "arch_string": arch.to_string(space), "search_space": space.to_dict(),
        "profile": profile.model_dump(), "profile_source": str(profile.source) if profile.source else None,
        "units": {"macs": "multiply-accumulates (1 MAC = 2 FLOPs)", "memory": "MiB, float32",
                  "latency": "ms per image at batch 1 (predicted) / per batch (measured)",
                  "energy": "mJ per image; J per epoch"},
        "cost": cost.to_dict() | {"flops_m": cost.flops_m,
                                  "energy_per_epoch_j": energy_per_epoch_j(cost.energy_mj, profile),
                                  "train_batch_size": b},
        "latency_source": "measured LUT " + str(profile.latency_lut_path()) if profile.latency_lut else "roofline",
        "layers": layer_docs,
        "totals": {"macs_fvcore": fv_sum * 1e6, "macs_thop": thop_total, "macs_conv_linear": cost.macs_m * 1e6,
                   "fvcore_by_operator": per_op},
        "host_latency": host,
        "budgets": [{"budget": c.budget, "value": c.value, "limit": c.limit, "passed": c.passed,
                     "margin": c.margin} for c in checks],
        "feasible": all(c.passed for c in checks),
        "fvcore_vs_thop": why,
    }

    # ---- chart: per-stage MACs and predicted latency
    stages: list[str] = []
    macs_by: dict[str, float] = {}
    lat_by: dict[str, float] = {}
    act_by: dict[str, float] = {}
    for d in layer_docs:
        st = d["stage"]
        if st not in macs_by:
            stages.append(st)
            macs_by[st], lat_by[st] = 0.0, 0.0
        macs_by[st] += d["macs_conv_linear"] / 1e6
        lat_by[st] += d["latency_ms"]
        act_by[st] = max(act_by.get(st, 0.0), d["activation_mb"])
    png = out_dir / f"{stem}.png"
    cost_figure(png, stages, [("MACs (M)", [macs_by[s] for s in stages]),
                              (f"predicted latency on {profile.name} (ms)", [lat_by[s] for s in stages]),
                              ("largest output activation (MiB, batch 1)", [act_by[s] for s in stages])],
                checks, title=f"{arch.r} px subnet on {profile.name}: {cost.macs_m:.3g} M MACs, "
                              f"{cost.latency_ms:.3g} ms predicted,\npeak inference memory {cost.peak_memory_mb:.3g} MiB, "
                              f"training memory {cost.train_memory_mb:.3g} MiB (batch {b})")

    # ---- markdown
    md = [f"# Cost report: `{arch.to_string(space)}` on `{profile.name}`", "",
          f"Device: {profile.description or profile.name}. Search space: width x{space.width_mult}, "
          f"{space.n_classes} classes, input {arch.r} px. MACs = multiply-accumulates of conv + linear "
          "layers (1 MAC = 2 FLOPs); memory in MiB (float32).", "",
          "## Summary", "",
          markdown_table(["metric", "value"], [
              ["MACs (M)", cost.macs_m], ["FLOPs (M, = 2 x MACs)", cost.flops_m], ["params (M)", cost.params_m],
              ["peak inference memory (MiB, batch 1)", cost.peak_memory_mb],
              [f"training memory (MiB, batch {b})", cost.train_memory_mb],
              [f"predicted latency on {profile.name} (ms/image, {doc['latency_source']})", cost.latency_ms],
              ["predicted energy (mJ/image)", cost.energy_mj],
              [f"predicted energy per local epoch (J, {profile.epoch_samples} samples)",
               doc["cost"]["energy_per_epoch_j"]],
          ], align="lr"),
          "## Budgets", "",
          markdown_table(["budget", "value", "limit", "result", "margin"],
                         [[c.budget, c.value, c.limit, c.passed, c.margin_text()] for c in checks],
                         align="lrrlr") if checks else "The profile sets no budgets.\n",
          f"**{'Feasible' if doc['feasible'] else 'Infeasible'}** on {profile.name}.", "",
          "## Per-layer costs", "",
          markdown_table(["layer", "type", "output shape", "MACs fvcore (M)", "MACs thop (M)",
                          "MACs conv+linear (M)", "params", "activation (MiB)", "pred. latency (ms)"],
                         rows, align="lllrrrrrr"),
          "## Why fvcore and thop differ", "", why, ""]
    if host:
        md += ["## Measured latency on this host", "",
               f"Host: {host['host']}, {torch.get_num_threads()} thread(s), inference mode, "
               f"{warmup} warm-up runs then timed repeats.", "",
               markdown_table(["batch", "median (ms)", "p90 (ms)", "median per image (ms)", "repeats"],
                              [[v["batch_size"], v["median_ms"], v["p90_ms"], v["median_ms"] / v["batch_size"],
                                v["repeats"]] for k, v in host.items() if k.startswith("batch_")], align="rrrrr")]
    md += ["## Per-stage MACs and latency", "", f"![per-stage MACs and latency]({png.name})", ""]
    atomic_write_text(out_dir / f"{stem}.md", "\n".join(md))
    atomic_write_json(out_dir / f"{stem}.json", _jsonable(doc))
    return doc


def cost_figure(path: Path, stages: list[str], panels: list[tuple[str, list[float]]], checks: list, *,
                title: str = "") -> Path:
    """The report's PNG: one bar chart per stage panel (MACs, predicted latency, activation
    memory), then every budget of the profile as the share of its limit that the subnet uses (one
    horizontal bar per budget, the limit a line at 100%, red when exceeded; a log axis once a value
    is 10x its limit or more, so a far-over budget does not flatten the others)."""
    n = len(panels) + (1 if checks else 0)
    fig, axes = new_figure(n, width=max(7.0, 0.8 * len(stages)), height=2.6)
    for ax, (label, values), color in zip(axes, panels, ("C0", "C1", "C2")):
        bars = ax.bar(range(len(stages)), values, color=color)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xticks(range(len(stages)), list(stages), fontsize=7)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if checks:
        ax = axes[-1]
        usable = [c for c in checks if math.isfinite(c.value) and c.limit > 0]
        shares = [100 * c.value / c.limit for c in usable]
        colors = ["C3" if not c.passed else "C2" for c in usable]
        y = range(len(usable))
        ax.barh(list(y), shares, color=colors)
        ax.axvline(100, color="black", lw=1, ls="--")
        ax.set_yticks(list(y), [f"{c.budget} ({c.value:.3g} / {c.limit:.3g})" for c in usable], fontsize=7)
        ax.invert_yaxis()
        if shares and max(shares) >= 1000:
            ax.set_xscale("log")
        for i, (c, v) in enumerate(zip(usable, shares)):
            ax.text(v, i, f" {c.margin_text()}", va="center", fontsize=7)
        ax.set_xlabel("share of the budget used (%; dashed line = the limit)", fontsize=8)
        ax.set_xlim(right=max([*shares, 100]) * (3 if max([*shares, 100]) >= 1000 else 1.45))
        ax.grid(axis="x", alpha=0.3)
    if title:
        axes[0].set_title(title, fontsize=9)
    return save_figure(fig, path)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (1e308 if obj > 0 else -1e308)
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def fmt_cost(cost) -> str:
    """One-line summary of a :class:`rafl.search.cost.Cost` (for CLI output)."""
    return (f"{fmt(cost.macs_m)} M MACs, {fmt(cost.params_m)} M params, peak {fmt(cost.peak_memory_mb)} MiB, "
            f"train {fmt(cost.train_memory_mb)} MiB, {fmt(cost.latency_ms)} ms, {fmt(cost.energy_mj)} mJ")
