"""Calibration of the cost model against published device latencies of the same networks (issue 43).

The published figures (``bench/data/published_latency.csv``, a 200 + 200 network sample with its
sources; re-made with ``--extract``):

* HW-NAS-Bench (Li et al., "HW-NAS-Bench: Hardware-Aware Neural Architecture Search Benchmark",
  ICLR 2021): latency of every network of two search spaces on a Raspberry Pi 4 (``raspi4``) and a
  Google Pixel 3 (``pixel3``), batch 1, ms.
  - ``nb201``: NAS-Bench-201 cells (Dong & Yang, ICLR 2020) on CIFAR-10 (32 px, C=16, N=5), whole
    networks measured on the device.
  - ``fbnet``: the FBNet space (Wu et al., CVPR 2019) on CIFAR-100 (32 px, stride-1 stem, 22
    MBConv / skip blocks): the sum of per-block latencies measured on the device (the benchmark's
    own lookup table, summed as its API does), the same per-layer sum as rafl's cost model.
  The values come from the copy of HW-NAS-Bench's table that HELP (Lee et al., NeurIPS 2021)
  ships (``data/nasbench201/latency/{raspi4,pixel3}.pt`` and ``data/fbnet/latency/*.pt``: its
  entries 0-2 equal the figures printed in HW-NAS-Bench's README). Networks with a ``none`` edge are
  left out of the NAS-Bench-201 sample (a cell with a zero op is not a network anyone deploys).
* HW-NAS-Bench's README also prints three latencies on its edge GPU (NVIDIA Jetson TX2) per space
  (``edgegpu_ms``); no Jetson Nano latency of these networks is public in a form we can read.

For every network the script builds it in PyTorch, counts its MACs with rafl's counting
(:func:`rafl.search.counting.model_macs_params`, checked against the analytic per-op list the
roofline uses) and predicts its latency with the roofline of :mod:`rafl.search.latency`
(``sum over ops of max(MACs / throughput, bytes / bandwidth) + layer_overhead_us`` per layer) with
(a) the shipped profile's coefficients and (b) coefficients fitted by least squares on the relative
error over half the networks (even rows) and evaluated on the other half (odd rows). A "layer"
(one ``layer_overhead_us``) is what the published figure times as one piece: an FBNet block (as a
rafl unit is an OFA block); for NAS-Bench-201, which times whole graphs, every conv, pool, add and
the classifier (one framework kernel each).

Error as nn-Meter reports it (Zhang et al., MobiSys 2021): the share of networks predicted within
+-10 % of the published latency, with the mean absolute percentage error and the RMSE (ms).

Then, with the cost model alone, which budget of each shipped profile binds on the shipped CIFAR-10
supernet's space (2,000 random subnets, the smallest and the largest).

Run: ``python bench/cost_calibration.py`` (about a minute of CPU). Writes
``bench/results/cost_calibration.md`` and ``.json``. ``--extract PATH_TO_HELP_CHECKOUT`` re-makes the CSV from HELP's files (needs torch).
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "published_latency.csv"
RESULTS = HERE / "results"
BYTES = 4  # float32, as the cost model
NB201_OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
NB201_EDGES = ((1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2))  # (to, from), in arch_str order
FBNET_OPS = ("k3_e1", "k3_e1_g2", "k3_e3", "k3_e6", "k5_e1", "k5_e1_g2", "k5_e3", "k5_e6", "skip")
FBNET_LAYERS = (1, 4, 4, 4, 4, 4, 1)
FBNET_CHANNELS = (16, 24, 32, 64, 112, 184, 352)
FBNET_STRIDES_CIFAR = (1, 1, 2, 2, 1, 2, 1)
# which shipped profile each published device checks
DEVICE_PROFILE = {"raspi4": "pi4", "pixel3": "phone", "edgegpu": "jetson-nano"}
# The coefficients shipped before the calibration (datasheet / whole-model figures, commit 1cbeba5):
# the baseline the fitted coefficients are compared against.
PREVIOUS = {"pi4": (6.5, 4.0, 40.0), "phone": (30.0, 15.0, 10.0), "jetson-nano": (40.0, 15.4, 25.0)}
SOURCES = {
    "raspi4": "HW-NAS-Bench (Li et al., ICLR 2021): Raspberry Pi 4, via HELP's copy (github.com/HayeonLee/HELP)",
    "pixel3": "HW-NAS-Bench (Li et al., ICLR 2021): Google Pixel 3, via HELP's copy (github.com/HayeonLee/HELP)",
    "edgegpu": "HW-NAS-Bench README (github.com/GATECH-EIC/HW-NAS-Bench): NVIDIA Jetson TX2, archs 0-2 only",
}


# --------------------------------------------------------------------------- the networks
Op = tuple[int, int]  # (MACs, bytes) of one op at batch 1
Unit = list[Op]  # the ops that one layer_overhead_us pays for


def _conv(cin: int, cout: int, k: int, h: int, stride: int = 1, groups: int = 1) -> tuple[Op, int]:
    """One conv: ((MACs, bytes in + out + weights), output side), as UnitSpec.op_bytes counts it."""
    ho = (h + 2 * (k // 2) - k) // stride + 1
    macs = cout * (cin // groups) * k * k * ho * ho
    return (macs, BYTES * (cin * h * h + cout * ho * ho + cout * (cin // groups) * k * k)), ho


def _memory_op(elements: int) -> Op:
    """An op without MACs (pool, add) that streams ``elements`` floats in and out."""
    return (0, BYTES * elements)


class _ReLUConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int, stride: int):
        super().__init__(nn.ReLU(), nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class _NB201Cell(nn.Module):
    def __init__(self, code: str, c: int):
        super().__init__()
        self.edges = [(to, frm, NB201_OPS[int(o)]) for (to, frm), o in zip(NB201_EDGES, code)]
        ops = []
        for _, _, name in self.edges:
            if name == "nor_conv_1x1":
                ops.append(_ReLUConvBN(c, c, 1, 1))
            elif name == "nor_conv_3x3":
                ops.append(_ReLUConvBN(c, c, 3, 1))
            elif name == "avg_pool_3x3":
                ops.append(nn.AvgPool2d(3, 1, 1, count_include_pad=False))
            else:
                ops.append(nn.Identity())
        self.ops = nn.ModuleList(ops)

    def forward(self, x):
        nodes = [x]
        for j in (1, 2, 3):
            terms = [op(nodes[frm]) for (to, frm, name), op in zip(self.edges, self.ops) if to == j and name != "none"]
            nodes.append(sum(terms) if terms else torch.zeros_like(x))
        return nodes[3]


class _NB201Reduction(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv_a, self.conv_b = _ReLUConvBN(cin, cout, 3, 2), _ReLUConvBN(cout, cout, 3, 1)
        self.down = nn.Sequential(nn.AvgPool2d(2, 2), nn.Conv2d(cin, cout, 1, bias=False))

    def forward(self, x):
        return self.down(x) + self.conv_b(self.conv_a(x))


def nb201_network(code: str, c: int = 16, n: int = 5, classes: int = 10, r: int = 32) -> tuple[nn.Module, list[Unit]]:
    """A NAS-Bench-201 CIFAR network (Dong & Yang, ICLR 2020, Sec. 2.1) and its ops, one unit each.

    Args:
        code: 6 digits, the op index (``NB201_OPS``) of each edge in ``NB201_EDGES`` order.

    Returns:
        the module (input ``(B, 3, r, r)``, output ``(B, classes)``) and its units: every conv,
        pool, node/residual add and the classifier is one unit (one framework kernel).
    """
    if len(code) != 6 or any(ch not in "01234" for ch in code):
        raise ValueError(f"a NAS-Bench-201 code is 6 digits 0-4, got {code!r}")
    units: list[Unit] = []
    op, h = _conv(3, c, 3, r)
    units.append([op])
    layers: list[nn.Module] = [nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)]
    widths = [c] * n + [2 * c] + [2 * c] * n + [4 * c] + [4 * c] * n
    cin = c
    for i, w in enumerate(widths):
        if i in (n, 2 * n + 1):  # residual reduction block
            layers.append(_NB201Reduction(cin, w))
            a, h2 = _conv(cin, w, 3, h, 2)
            b, _ = _conv(w, w, 3, h2)
            d, _ = _conv(cin, w, 1, h // 2)
            units += [[a], [b], [_memory_op(cin * h * h + cin * h2 * h2)], [d], [_memory_op(3 * w * h2 * h2)]]
            h = h2
        else:
            cell = _NB201Cell(code, w)
            layers.append(cell)
            for to in (1, 2, 3):
                terms = [name for (t, _, name) in cell.edges if t == to and name != "none"]
                for name in terms:
                    if name.startswith("nor_conv"):
                        units.append([_conv(w, w, int(name[-1]), h)[0]])
                    elif name == "avg_pool_3x3":
                        units.append([_memory_op(2 * w * h * h)])
                units += [[_memory_op(3 * w * h * h)]] * max(len(terms) - 1, 0)
        cin = w
    layers += [nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    units.append([_memory_op(cin * h * h + cin), (cin * classes, BYTES * (cin + classes + cin * classes))])
    return nn.Sequential(*layers), units


class _FBNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, e: int, k: int, stride: int, groups: int):
        super().__init__()
        mid = cin * e
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, groups=groups, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, cout, 1, groups=groups, bias=False), nn.BatchNorm2d(cout))
        self.residual = cin == cout and stride == 1

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


def fbnet_network(code: str, classes: int = 100, r: int = 32) -> tuple[nn.Module, list[Unit]]:
    """A network of HW-NAS-Bench's FBNet space on CIFAR-100 (FBNet, Wu et al., CVPR 2019, Table 1
    widths; stride-1 stem and strides 1,1,2,2,1,2,1 for 32 px) and its per-block units.

    Args:
        code: 22 digits, each block's op index in ``FBNET_OPS``.

    Returns:
        the module (input ``(B, 3, r, r)``, output ``(B, classes)``) and its units: stem, each
        block (``skip`` without a projection has no op), the 1x1 header, pool + classifier.
    """
    if len(code) != 22 or any(ch not in "012345678" for ch in code):
        raise ValueError(f"an FBNet code is 22 digits 0-8, got {code!r}")
    op, h = _conv(3, 16, 3, r)
    units: list[Unit] = [[op]]
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin, i = 16, 0
    for stage, (n, cout, s) in enumerate(zip(FBNET_LAYERS, FBNET_CHANNELS, FBNET_STRIDES_CIFAR)):
        for j in range(n):
            stride = s if j == 0 else 1
            name = FBNET_OPS[int(code[i])]
            i += 1
            if name == "skip":
                if stride == 2 or cin != cout:
                    layers += [nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
                    op, h = _conv(cin, cout, 1, h, stride)
                    units.append([op])
                else:
                    units.append([])
            else:
                k, e = int(name[1]), int(name[4])
                g = 2 if name.endswith("_g2") else 1
                layers.append(_FBNetBlock(cin, cout, e, k, stride, g))
                a, _ = _conv(cin, cin * e, 1, h, 1, g)
                b, h2 = _conv(cin * e, cin * e, k, h, stride, cin * e)
                c, _ = _conv(cin * e, cout, 1, h2, 1, g)
                unit = [a, b, c] + ([_memory_op(3 * cout * h2 * h2)] if cin == cout and stride == 1 else [])
                units.append(unit)
                h = h2
            cin = cout
    op, _ = _conv(cin, 1504, 1, h)
    units.append([op])
    layers += [nn.Conv2d(cin, 1504, 1, bias=False), nn.BatchNorm2d(1504), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(), nn.Linear(1504, classes)]
    units.append([_memory_op(1504 * h * h + 1504), (1504 * classes, BYTES * (1504 + classes + 1504 * classes))])
    return nn.Sequential(*layers), units


def build(space: str, code: str) -> tuple[nn.Module, list[Unit]]:
    """The network ``code`` of ``space`` (``nb201`` or ``fbnet``) and its units."""
    if space == "nb201":
        return nb201_network(code)
    if space == "fbnet":
        return fbnet_network(code)
    raise ValueError(f"space is nb201 or fbnet, got {space!r}")


def unit_macs(units: list[Unit]) -> int:
    """Total MACs of a unit list (conv + linear)."""
    return sum(m for u in units for m, _ in u)


# --------------------------------------------------------------------------- the model
def roofline_ms(units: list[Unit], throughput_gmacs: float, bandwidth_gbs: float, overhead_us: float) -> float:
    """rafl's roofline (:func:`rafl.search.latency.roofline_latency_ms`) summed over ``units``:
    ``sum over ops max(MACs / P, bytes / B) + overhead`` per unit that has an op, ms."""
    seconds = sum(max(m / (throughput_gmacs * 1e9), b / (bandwidth_gbs * 1e9)) for u in units for m, b in u)
    return seconds * 1e3 + overhead_us * 1e-3 * sum(1 for u in units if u)


@dataclass(frozen=True)
class Errors:
    """nn-Meter's accuracy metrics of predictions against published latencies.

    Attributes:
        n: networks.
        within_10: share predicted within +-10 % (0..1).
        mape: mean absolute percentage error, %.
        rmse_ms: root mean squared error, ms.
        bias: mean signed relative error (prediction / published - 1), %.
    """

    n: int
    within_10: float
    mape: float
    rmse_ms: float
    bias: float


def errors(pred, true) -> Errors:
    """:class:`Errors` of ``pred`` against ``true`` (ms, same length, true > 0).

    Raises:
        ValueError: empty or mismatched inputs, or a published latency <= 0.
    """
    p, t = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    if p.size == 0 or p.shape != t.shape or not np.all(t > 0):
        raise ValueError("errors needs as many predictions as published latencies, all latencies > 0")
    rel = p / t - 1.0
    return Errors(int(p.size), float(np.mean(np.abs(rel) <= 0.10)), float(100 * np.mean(np.abs(rel))),
                  float(np.sqrt(np.mean((p - t) ** 2))), float(100 * np.mean(rel)))


def fit_roofline(unit_lists: list[list[Unit]], latencies_ms) -> tuple[float, float, float]:
    """``(throughput_gmacs, bandwidth_gbs, overhead_us)`` minimizing the squared relative error of
    :func:`roofline_ms` against ``latencies_ms`` (scipy least squares in log space, so all three
    stay > 0; from several starts, the best kept)."""
    from scipy.optimize import least_squares

    y = np.asarray(latencies_ms, dtype=float)

    def residuals(x):
        p, b, o = np.exp(x)
        return np.array([roofline_ms(u, p, b, o) for u in unit_lists]) / y - 1.0

    best = None
    for start in ((1.0, 1.0, 10.0), (10.0, 10.0, 10.0), (30.0, 5.0, 100.0), (3.0, 30.0, 1.0)):
        res = least_squares(residuals, np.log(start), method="trf")
        if best is None or res.cost < best.cost:
            best = res
    p, b, o = np.exp(best.x)
    return float(p), float(b), float(o)


# --------------------------------------------------------------------------- data
def load_published(path: Path = DATA) -> list[dict]:
    """Rows of the published-latency CSV: ``space``, ``code``, and ``raspi4_ms`` / ``pixel3_ms`` /
    ``edgegpu_ms`` (float or None)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            out = {"space": row["space"], "code": row["code"]}
            for dev in DEVICE_PROFILE:
                v = row.get(f"{dev}_ms", "")
                out[f"{dev}_ms"] = float(v) if v not in ("", None) else None
            rows.append(out)
    return rows


def extract(help_dir: Path, out: Path, n: int, seed: int) -> None:
    """Write the CSV from a HELP checkout (``data/nasbench201``, ``data/fbnet``): ``n`` networks of
    each space drawn with ``seed`` (NAS-Bench-201: among those without a ``none`` edge)."""
    rng = np.random.default_rng(seed)
    nb = help_dir / "data" / "nasbench201"
    str2idx = torch.load(nb / "str_arch2idx.pt", weights_only=False)
    lat = {d: np.asarray(torch.load(nb / "latency" / f"{d}.pt", weights_only=False)) for d in ("raspi4", "pixel3")}
    codes = {}
    for arch_str, idx in str2idx.items():
        names = [tok.split("~")[0] for tok in arch_str.strip("|").replace("|+|", "|").split("|")]
        if "none" not in names:
            codes["".join(str(NB201_OPS.index(x)) for x in names)] = idx
    readme = {0: 5.807418537139893, 1: 6.547689437866211, 2: 6.509256362915039}  # HW-NAS-Bench README, cifar10
    picked = sorted(codes, key=lambda c: codes[c])
    chosen = [c for c in picked if codes[c] in readme]
    rest = [c for c in picked if codes[c] not in readme]
    chosen += [rest[i] for i in sorted(rng.choice(len(rest), n - len(chosen), replace=False))]
    fb = help_dir / "data" / "fbnet"
    archs = torch.load(fb / "metainfo.pt", weights_only=False)["arch"]
    flat = {d: np.asarray(torch.load(fb / "latency" / f"{d}.pt", weights_only=False)) for d in ("raspi4", "pixel3")}
    fb_pick = sorted(rng.choice(len(archs), n, replace=False))
    lines = [
        "# Published batch-1 latencies (ms) of CIFAR networks, a sample; sources in bench/cost_calibration.py.",
        "# nb201: NAS-Bench-201 CIFAR-10 networks (code: op index per edge, ops none/skip/conv1x1/conv3x3/avgpool3x3),",
        "#   HW-NAS-Bench (Li et al., ICLR 2021) raspi4/pixel3 whole-network measurements; edgegpu (Jetson TX2)",
        "#   only for the three archs its README prints. fbnet: HW-NAS-Bench's FBNet space on CIFAR-100",
        "#   (code: op index per block, k3_e1 k3_e1_g2 k3_e3 k3_e6 k5_e1 k5_e1_g2 k5_e3 k5_e6 skip), sums of per-block",
        "#   device measurements. Values from HELP's copy (github.com/HayeonLee/HELP, data/*/latency/*.pt).",
        "space,code,hwnasbench_index,raspi4_ms,pixel3_ms,edgegpu_ms",
    ]
    for c in chosen:
        i = codes[c]
        lines.append(f"nb201,{c},{i},{lat['raspi4'][i]:.4f},{lat['pixel3'][i]:.4f},{readme.get(i, '')}")
    fb_readme = {"0" * 22: 15.804523468017578, "0" * 21 + "1": 16.861193418502808, "0" * 20 + "11": 18.126894235610962}
    for i in fb_pick:
        code = "".join(str(v) for v in archs[i]["op_idx_list"])
        lines.append(f"fbnet,{code},{i},{flat['raspi4'][i]:.4f},{flat['pixel3'][i]:.4f},")
    for code, v in fb_readme.items():  # README-only networks: edge GPU figure, no Pi / Pixel in this copy
        lines.append(f"fbnet,{code},,,,{v}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} ({len(lines)} lines)")


# --------------------------------------------------------------------------- main
def calibrate(rows: list[dict], check_macs: int = 10) -> dict:
    """Predict every published latency with the shipped profile and with a fit per (device, space);
    returns the report dict (see :func:`main`)."""
    from rafl.search.counting import model_macs_params
    from rafl.search.profile import load_profile

    built = {(r["space"], r["code"]): build(r["space"], r["code"]) for r in rows}
    mac_checks = []
    for space in ("nb201", "fbnet"):  # rafl's counting (fvcore conv + linear) against the analytic op list
        for r in [r for r in rows if r["space"] == space][:check_macs]:
            module, units = built[(space, r["code"])]
            counted, _ = model_macs_params(module, 32)
            mac_checks.append({"space": space, "code": r["code"], "rafl_macs_m": counted,
                               "roofline_macs_m": unit_macs(units) / 1e6})
    report = {"mac_checks": mac_checks, "results": []}
    for dev, prof_name in DEVICE_PROFILE.items():
        prof = load_profile(prof_name)
        shipped = (prof.throughput_gmacs, prof.mem_bandwidth_gbs, prof.layer_overhead_us)
        for space in ("nb201", "fbnet"):
            sel = [r for r in rows if r["space"] == space and r[f"{dev}_ms"] is not None]
            if not sel:
                continue
            units = [built[(space, r["code"])][1] for r in sel]
            y = np.array([r[f"{dev}_ms"] for r in sel])
            pred = np.array([roofline_ms(u, *shipped) for u in units])
            entry = {"device": dev, "profile": prof_name, "space": space, "n": len(sel),
                     "published_ms": [float(y.min()), float(np.median(y)), float(y.max())],
                     "macs_m": [float(min(unit_macs(u) for u in units) / 1e6), float(max(unit_macs(u) for u in units) / 1e6)],
                     "before calibration": {"coefficients": PREVIOUS[prof_name],
                                            **errors([roofline_ms(u, *PREVIOUS[prof_name]) for u in units], y).__dict__},
                     "shipped": {"coefficients": shipped, **errors(pred, y).__dict__}}
            if len(sel) >= 20:
                train, test = slice(0, None, 2), slice(1, None, 2)
                coef = fit_roofline(units[train], y[train])
                pred_fit = np.array([roofline_ms(u, *coef) for u in units])
                entry["fitted"] = {"coefficients": coef, "train": errors(pred_fit[train], y[train]).__dict__,
                                   **errors(pred_fit[test], y[test]).__dict__}
            report["results"].append(entry)
    # transfer: each space's fitted coefficients on all networks of the other space
    fits = {(e["device"], e["space"]): e["fitted"]["coefficients"] for e in report["results"] if "fitted" in e}
    for e in report["results"]:
        other = "nb201" if e["space"] == "fbnet" else "fbnet"
        if (e["device"], other) in fits:
            sel = [r for r in rows if r["space"] == e["space"] and r[f"{e['device']}_ms"] is not None]
            coef = fits[(e["device"], other)]
            pred = [roofline_ms(built[(e["space"], r["code"])][1], *coef) for r in sel]
            e[f"fitted on {other}"] = {"coefficients": coef,
                                       **errors(pred, [r[f"{e['device']}_ms"] for r in sel]).__dict__}
    # the edge GPU: too few published networks to fit three coefficients; the per-layer overhead
    # alone (throughput and bandwidth as the profile has them), on all of them (no held-out set)
    for e in report["results"]:
        if e["device"] != "edgegpu":
            continue
        sel = [r for r in rows if r["space"] == e["space"] and r["edgegpu_ms"] is not None]
        units = [built[(e["space"], r["code"])][1] for r in sel]
        p, b, _ = e["shipped"]["coefficients"]
        y = np.array([r["edgegpu_ms"] for r in sel])
        n_units = np.array([sum(1 for u in us if u) for us in units])
        compute = np.array([roofline_ms(us, p, b, 0.0) for us in units])
        overhead = float(np.mean((y - compute) / n_units) * 1e3)
        pred = [roofline_ms(us, p, b, overhead) for us in units]
        e["overhead only (all 3)"] = {"coefficients": (p, b, overhead), **errors(pred, y).__dict__}
    return report


def budget_bindings(n_archs: int = 2000, seed: int = 0) -> list[dict]:
    """Which budget of each shipped profile binds on the shipped CIFAR-10 supernet's space: per
    budget, the smallest and largest subnet's value and the share of ``n_archs`` random subnets
    within it (cost model only, nothing measured)."""
    from rafl.search.cost import CostModel, check_budgets, energy_per_epoch_j
    from rafl.search.profile import list_profiles, load_profile
    from rafl.supernet.checkpoint import load_supernet

    space = load_supernet("cifar10").space
    rng = np.random.default_rng(seed)
    archs = [space.sample(rng) for _ in range(n_archs)]
    macs = CostModel(space).batch(archs)["macs_m"]
    out = []
    for name in list_profiles():
        model = CostModel(space, load_profile(name))
        costs = model.batch(archs)
        ends = [check_budgets(model.cost(a), model.profile) for a in (space.smallest(), space.largest())]
        feasible = model.feasible(archs)
        row = {"profile": name, "feasible_share": float(feasible.mean()),
               "best_feasible_macs_m": float(macs[feasible].max()) if feasible.any() else None, "budgets": []}
        for i, (budget, limit) in enumerate(model.profile.effective_budgets()):
            values = costs[budget] if budget in costs else energy_per_epoch_j(costs["energy_mj"], model.profile)
            row["budgets"].append({"budget": budget, "limit": limit, "smallest": ends[0][i].value,
                                   "largest": ends[1][i].value, "share_within": float(np.mean(values <= limit))})
        out.append(row)
    return out


def render(report: dict) -> str:
    """The markdown table of :func:`calibrate`'s report."""
    out = ["# Cost-model calibration against published latencies (`python bench/cost_calibration.py`)", "",
           "Roofline `sum max(MACs/P, bytes/B) + overhead per layer` against HW-NAS-Bench's published batch-1",
           "latencies of the same CIFAR networks (sources: `bench/cost_calibration.py`, data sample:",
           "`bench/data/published_latency.csv`). nn-Meter's metric: share of networks within +-10 %; MAPE;",
           "RMSE. *before calibration*: the coefficients shipped before (datasheet figures); *shipped*: the",
           "profile's coefficients at the time of the run; *fitted*: least squares on",
           "the relative error over the even rows, errors on the held-out odd rows; *fitted on X*: the",
           "coefficients fitted on the other space, on all networks of this one; *overhead only*: the",
           "per-layer overhead fitted on all three edge-GPU networks of the space (no held-out set), P and B",
           "as shipped. A layer is an FBNet block, or one kernel of a NAS-Bench-201 network (timed whole).", "",
           "| device (profile) | space | n | published ms (min / median / max) | model | P GMAC/s | B GB/s "
           "| overhead us | within +-10 % | MAPE % | RMSE ms | bias % |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["results"]:
        pub = " / ".join(f"{v:.2f}" for v in e["published_ms"])
        for label in [k for k in e if isinstance(e[k], dict) and "coefficients" in e[k]]:
            m = e[label]
            p, b, o = m["coefficients"]
            n = m["n"]
            out.append(f"| {e['device']} ({e['profile']}) | {e['space']} | {n} | {pub} | {label} | {p:.3g} | {b:.3g} | "
                       f"{o:.3g} | {100 * m['within_10']:.0f} % | {m['mape']:.1f} | {m['rmse_ms']:.2f} | {m['bias']:+.1f} |")
    worst = max(abs(c["rafl_macs_m"] - c["roofline_macs_m"]) for c in report["mac_checks"])
    out += ["", f"MACs: rafl's counting (fvcore conv + linear) against the roofline's op list on "
            f"{len(report['mac_checks'])} networks: largest difference {worst:.4f} M."]
    if report.get("bindings"):
        out += ["", "## Which budgets bind on the shipped CIFAR-10 supernet's space (cost model, 2,000 random subnets)", "",
                "| profile | budget | limit | smallest subnet | largest subnet | random subnets within "
                "| all budgets met | largest MACs among those (M) |",
                "|---|---|---|---|---|---|---|---|"]
        for row in report["bindings"]:
            best = row["best_feasible_macs_m"]
            for b in row["budgets"]:
                out.append(f"| {row['profile']} | {b['budget']} | {b['limit']:.4g} | {b['smallest']:.4g} | {b['largest']:.4g} | "
                           f"{100 * b['share_within']:.0f} % | {100 * row['feasible_share']:.0f} % | "
                           f"{'-' if best is None else f'{best:.2f}'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--extract", type=Path, default=None, metavar="HELP_DIR",
                    help="re-make --data from a HELP checkout, then calibrate")
    ap.add_argument("--n", type=int, default=200, help="networks per space drawn by --extract")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if args.extract is not None:
        extract(args.extract, args.data, args.n, args.seed)
    torch.set_num_threads(1)
    report = calibrate(load_published(args.data))
    report["bindings"] = budget_bindings()
    text = render(report)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "cost_calibration.md").write_text(text)
        (RESULTS / "cost_calibration.json").write_text(json.dumps(report, indent=1, default=float))
    return report


if __name__ == "__main__":
    main()
