"""The calibration of the cost model against published latencies (bench/cost_calibration.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rafl.search.counting import model_macs_params
from rafl.search.latency import roofline_latency_ms
from rafl.search.profile import load_profile
from rafl.search.units import fixed_units, slot_units
from rafl.supernet.arch import SearchSpace

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cost_calibration.py"


@pytest.fixture(scope="module")
def calib():
    spec = importlib.util.spec_from_file_location("cost_calibration", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_bench_roofline_is_rafls_roofline(calib):
    """The bench prices a unit as rafl's cost model does (same ops, bytes, overhead)."""
    space = SearchSpace(width_mult=0.35)
    head, tail = fixed_units(space, 32)
    specs = [s for _, s in head + tail] + [slot_units(space, 32)[3][1][2]]
    for name in ("pi4", "phone", "jetson-nano"):
        p = load_profile(name)
        for spec in specs:
            ours = calib.roofline_ms([spec.op_bytes()], p.throughput_gmacs, p.mem_bandwidth_gbs, p.layer_overhead_us)
            assert ours == pytest.approx(roofline_latency_ms(spec, p), rel=1e-12)


@pytest.mark.parametrize("space,code", [("nb201", "334131"), ("fbnet", "7818488874147327327424")])
def test_networks_run_and_rafl_counts_the_macs_the_roofline_prices(calib, space, code):
    module, units = calib.build(space, code)
    module.eval()
    with torch.no_grad():
        out = module(torch.zeros(2, 3, 32, 32))
    assert out.shape == (2, 10 if space == "nb201" else 100)
    counted, _ = model_macs_params(module, 32)
    assert counted == pytest.approx(calib.unit_macs(units) / 1e6, abs=1e-9)


def test_codes_outside_the_space_are_refused(calib):
    with pytest.raises(ValueError, match="6 digits"):
        calib.build("nb201", "12345")
    with pytest.raises(ValueError, match="22 digits"):
        calib.build("fbnet", "9" * 22)
    with pytest.raises(ValueError, match="nb201 or fbnet"):
        calib.build("darts", "0")


def test_errors_are_nn_meters_metrics(calib):
    e = calib.errors([1.05, 1.2, 0.5], [1.0, 1.0, 1.0])
    assert e.n == 3 and e.within_10 == pytest.approx(1 / 3)
    assert e.mape == pytest.approx(25.0) and e.bias == pytest.approx((5 + 20 - 50) / 3)
    assert e.rmse_ms == pytest.approx(math.sqrt((0.05**2 + 0.2**2 + 0.5**2) / 3))
    with pytest.raises(ValueError):
        calib.errors([1.0], [0.0])


def test_the_fit_recovers_known_coefficients(calib):
    rng = np.random.default_rng(0)
    codes = ["".join(str(v) for v in rng.integers(0, 9, 22)) for _ in range(12)]
    units = [calib.fbnet_network(c)[1] for c in codes]
    truth = (5.0, 0.8, 30.0)
    y = [calib.roofline_ms(u, *truth) for u in units]
    fitted = calib.fit_roofline(units, y)
    assert np.allclose(fitted, truth, rtol=0.02), fitted


def test_shipped_pi4_and_phone_predict_the_published_mbconv_latencies(calib):
    """The shipped coefficients stay calibrated: on the committed FBNet-space sample (MBConv blocks,
    as rafl's units) most networks are predicted within +-10 % of HW-NAS-Bench's latency."""
    rows = [r for r in calib.load_published() if r["space"] == "fbnet" and r["raspi4_ms"] is not None][:60]
    assert len(rows) == 60
    units = [calib.fbnet_network(r["code"])[1] for r in rows]
    for device, profile in (("raspi4", "pi4"), ("pixel3", "phone")):
        p = load_profile(profile)
        pred = [calib.roofline_ms(u, p.throughput_gmacs, p.mem_bandwidth_gbs, p.layer_overhead_us) for u in units]
        e = calib.errors(pred, [r[f"{device}_ms"] for r in rows])
        assert e.within_10 >= 0.8 and abs(e.bias) < 5, (profile, e)
