"""Budgets that bind, the binding budget named, the predictor's training set and measurement cache,
the LUT's network correction, the picks picture, and no default budget override."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from rafl.search.cost import CostModel
from rafl.search.estimators import MeasuredAccuracy, sample_across_space
from rafl.search.evolution import (
    binding_budget,
    binding_text,
    budget_use,
    cost_fn_for,
    profile_limits,
)
from rafl.search.genome import Population
from rafl.search.profile import load_profile
from rafl.supernet import SearchSpace, build_supernet

EDGE = ("pi4", "jetson-nano", "phone", "server-gpu")


def test_shipped_latency_budgets_bind_on_the_cifar10_space():
    """On the shipped CIFAR-10 space (width 0.35, 24-32 px) every edge profile admits its smallest
    subnet and excludes the largest (the budgets bind), and the share of random subnets the three
    edge devices admit follows their order pi4 < jetson-nano < phone."""
    space = SearchSpace(width_mult=0.35, resolutions=(24, 28, 32), n_classes=10)
    pop = Population.sample(space, 400, np.random.default_rng(0))
    ends = Population.from_archs(space, [space.smallest(), space.largest()])
    shares = []
    for name in EDGE:
        prof = load_profile(name)
        fn, lim = cost_fn_for(CostModel(space, prof)), profile_limits(prof)
        c = fn(ends)
        ok = np.all([c[k] <= v for k, v in lim.items()], axis=0)
        assert ok.tolist() == [True, False], name
        cp = fn(pop)
        shares.append(float(np.mean(np.all([cp[k] <= v for k, v in lim.items()], axis=0))))
    assert 0 < shares[0] < shares[1] < shares[2] < 1 and shares[3] < 1


def test_budget_use_names_the_binding_budget():
    use = budget_use({"macs_m": 4.0, "latency_ms": 1.47, "energy_mj": 2.0}, {"macs_m": 10, "latency_ms": 1.5,
                                                                            "energy_mj": 9.6})
    assert [u["budget"] for u in use] == ["latency_ms", "macs_m", "energy_mj"]
    assert binding_budget(use)["budget"] == "latency_ms" and binding_text(use) == "latency_ms 1.47 of 1.5 (98%)"
    loose = budget_use({"latency_ms": 0.5}, {"latency_ms": 1.0})
    assert binding_budget(loose) is None and binding_text(loose) == "no budget binds (most used: latency_ms at 50%)"


def test_predictor_samples_spread_over_the_space():
    space = SearchSpace(width_mult=0.25, resolutions=(12, 14, 16), n_classes=10)
    archs = sample_across_space(space, 60, seed=1)
    keys = [a.to_string() for a in archs]
    assert len(set(keys)) == 60 and space.smallest().canonical(space).to_string() in keys
    assert space.largest().to_string() in keys
    counts = np.bincount([space.resolutions.index(a.r) for a in archs])
    assert counts.max() - counts.min() <= 2
    assert keys == [a.to_string() for a in sample_across_space(space, 60, seed=1)]  # deterministic


def test_measurements_are_cached_per_supernet_on_disk(tmp_path):
    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(12,), n_classes=10)
    net = build_supernet(space).eval()
    g = torch.Generator().manual_seed(0)
    val = (torch.randn(16, 3, 12, 12, generator=g), torch.randint(0, 10, (16,), generator=g))
    calib = torch.randn(8, 3, 12, 12, generator=g)
    archs = sample_across_space(space, 4, seed=0)
    first = MeasuredAccuracy(net, val, calib, batch_size=8, calib_batches=1, cache_dir=tmp_path)
    acc = first.measure(archs)
    assert first.n_measured == 4 and first.cache_path.is_file()
    again = MeasuredAccuracy(net, val, calib, batch_size=8, calib_batches=1, cache_dir=tmp_path)
    assert np.array_equal(again.measure(archs), acc) and again.n_measured == 0
    torch.manual_seed(1)
    other = MeasuredAccuracy(build_supernet(space).eval(), val, calib, batch_size=8, calib_batches=1,
                             cache_dir=tmp_path)
    assert other.cache_path != first.cache_path and other.cache == {}
    # same as measuring without the cache (the batched, channels-last path changes nothing)
    plain = MeasuredAccuracy(net, val, calib, batch_size=8, calib_batches=1)
    assert np.allclose(plain.measure(archs), acc)


@pytest.mark.slow
def test_measuring_in_forked_workers_gives_the_same_accuracies(tmp_path):
    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(12, 16), n_classes=10)
    net = build_supernet(space).eval()
    g = torch.Generator().manual_seed(0)
    val = (torch.randn(24, 3, 16, 16, generator=g), torch.randint(0, 10, (24,), generator=g))
    calib = torch.randn(8, 3, 16, 16, generator=g)
    archs = sample_across_space(space, 20, seed=0)
    one = MeasuredAccuracy(net, val, calib, batch_size=8, calib_batches=1, workers=1).measure(archs)
    two = MeasuredAccuracy(net, val, calib, batch_size=8, calib_batches=1, workers=2, cache_dir=tmp_path)
    assert two._worker_count(20) == 2
    got = two.measure(archs, save_every=4)  # 5 chunks over 2 processes, the cache saved as they come back
    assert np.array_equal(got, one) and two.n_measured == 20
    again = MeasuredAccuracy(net, val, calib, batch_size=8, calib_batches=1, workers=2, cache_dir=tmp_path)
    assert len(again.cache) == 20 and np.array_equal(again.measure(archs), one) and again.n_measured == 0


def test_lut_network_correction_is_stored_and_applied(tmp_path):
    from rafl.search.latency import build_latency_lut, latency_lut_correction
    from rafl.search.profile import DeviceProfile
    from rafl.search.units import arch_units, fixed_units, slot_units

    space = SearchSpace(width_mult=0.25, resolutions=(12,), n_classes=10)
    head, tail = fixed_units(space, 12)
    specs = [s for _, s in head + tail] + [s for row in slot_units(space, 12) for col in row for s in col]
    lut = tmp_path / "lut.yaml"
    entries = build_latency_lut(specs, lut, warmup=0, repeats=1, progress=False, clock="thread", statistic="min",
                                space=space, calibrate=3)
    doc = yaml.safe_load(lut.read_text())
    assert doc["statistic"] == "min" and doc["network_correction"]["n_subnets"] == 3
    a, b = latency_lut_correction(lut)
    assert a > 0
    prof = DeviceProfile.from_dict({"name": "host", "throughput_gmacs": 1.0, "mem_bandwidth_gbs": 1.0,
                                    "latency_lut": str(lut)})
    arch = space.sample(np.random.default_rng(0))
    want = a * sum(entries[s.key] for _, s in arch_units(space, arch)) + b
    assert CostModel(space, prof).cost(arch).latency_ms == pytest.approx(want, rel=1e-9)


def test_picks_plot_draws_an_off_scale_budget_as_an_arrow(tmp_path):
    from rafl.search.pareto import save_picks_plot

    path = tmp_path / "pareto.png"
    save_picks_plot(path, {"pi4": {"latency_ms": 1.45, "accuracy": 0.6, "predicted_accuracy": 0.62,
                                   "latency_budget_ms": 1.5, "arch": "a"},
                           "server-gpu": {"latency_ms": 0.24, "accuracy": 0.7, "predicted_accuracy": None,
                                          "latency_budget_ms": 10.0, "arch": "b"}}, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_run_sets_no_budget_override():
    from rafl.config import ClientsConfig

    assert ClientsConfig().budgets == {}


def test_network_correction_fit_recovers_a_and_b_and_stays_positive_on_noise():
    from rafl.search.latency import fit_network_correction

    sums = np.array([2.0, 3.0, 5.0, 8.0])
    a, b, method = fit_network_correction(sums, 1.5 * sums + 0.7)
    assert (a, b) == (pytest.approx(1.5), pytest.approx(0.7)) and "+ b_ms" in method
    # Timings that fall as the layer sums grow (a loaded host, one repeat): the two-term slope
    # would be negative, so the one-term model a x sum is fitted (b = 0) and the method says why.
    y = np.array([9.0, 8.0, 7.5, 7.0])
    a, b, method = fit_network_correction(sums, y)
    r = sums / y
    assert a == pytest.approx(r.sum() / (r * r).sum()) and a > 0 and b == 0.0
    assert "two-term fit gave" in method
    with pytest.raises(ValueError, match="all > 0"):
        fit_network_correction([1.0, 0.0], [1.0, 2.0])
