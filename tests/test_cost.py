"""Cost model: LUT MACs/params vs fvcore on rafl's extracted subnets, peak memory vs the fx/networkx
analysis and a CPU measurement, training memory vs autograd's saved tensors, latency/energy, LUTs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from rafl.errors import UserInputError
from rafl.search.cost import Cost, CostModel, check_budgets
from rafl.search.latency import build_latency_lut, roofline_latency_ms
from rafl.search.memory import SubnetBody, fx_peak_memory, measure_peak_memory, measure_saved_activations
from rafl.search.profile import DeviceProfile
from rafl.search.units import arch_units
from rafl.supernet import build_supernet, extract_subnet
from rafl.supernet.arch import ArchConfig, SearchSpace

SPACE = SearchSpace(width_mult=0.25)


@pytest.fixture(scope="module")
def supernet():
    torch.manual_seed(0)
    return build_supernet(SPACE).eval()


@pytest.fixture(scope="module")
def model():
    return CostModel(SPACE)


def _archs(n: int, seed: int = 0) -> list[ArchConfig]:
    rng = np.random.default_rng(seed)
    return [SPACE.smallest(), SPACE.largest()] + [SPACE.sample(rng) for _ in range(n - 2)]


@pytest.mark.slow
def test_lut_macs_and_params_match_fvcore_on_50_extracted_subnets(supernet, model):
    from fvcore.nn import FlopCountAnalysis

    archs = _archs(50)
    costs = model.batch(archs)
    for i, arch in enumerate(archs):
        sub = extract_subnet(supernet, arch).eval()
        x = torch.zeros(1, 3, arch.r, arch.r)
        counts = (FlopCountAnalysis(sub, x).unsupported_ops_warnings(False)
                  .uncalled_modules_warnings(False).by_operator())
        fv = (counts.get("conv", 0) + counts.get("linear", 0) + counts.get("addmm", 0)) / 1e6
        assert abs(costs["macs_m"][i] - fv) <= 0.01 * fv, (arch, costs["macs_m"][i], fv)
        params = sum(p.numel() for p in sub.parameters()) / 1e6
        assert abs(costs["params_m"][i] - params) <= 1e-9, arch


@pytest.mark.slow
def test_peak_memory_equals_fx_analysis_of_the_whole_subnet_and_the_measurement(supernet, model):
    for arch in _archs(5, seed=1):
        sub = extract_subnet(supernet, arch).eval()
        body = SubnetBody(sub)
        x = torch.randn(1, 3, arch.r, arch.r)
        with torch.no_grad():
            assert torch.allclose(body(x), sub(x))
        trace = fx_peak_memory(body, tuple(x.shape))
        lut = model.cost(arch).peak_memory_mb * 2**20
        assert lut == pytest.approx(trace.peak_bytes, rel=1e-9)
        # measured on CPU: the traced GraphModule frees values after their last use like the analysis
        measured = measure_peak_memory(torch.fx.symbolic_trace(body), x)
        assert measured == pytest.approx(trace.peak_bytes, rel=0.01)
        # eager Python keeps some tensors longer (module call frames): never less than the estimate
        assert measure_peak_memory(sub, x) >= 0.99 * trace.peak_bytes


def test_fx_peak_memory_on_a_hand_checked_graph():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(inplace=True),
                        nn.Conv2d(8, 4, 1, bias=False)).eval()
    # input 3x10x10 (held), conv1 out 8x10x10, relu in place, conv2 out 4x10x10 while conv1 out is live
    held = fx_peak_memory(net, (1, 3, 10, 10), hold_input=True)
    assert held.peak_bytes == 4 * 100 * (3 + 8 + 4)
    freed = fx_peak_memory(net, (1, 3, 10, 10), hold_input=False)
    assert freed.peak_bytes == 4 * 100 * (8 + 4)
    assert held.graph.number_of_nodes() == 5 and held.out_bytes[held.order[2]] == 0  # relu_ aliases
    assert measure_peak_memory(torch.fx.symbolic_trace(net), torch.randn(1, 3, 10, 10)) == held.peak_bytes


def test_training_memory_matches_saved_tensors_of_the_subnet(supernet):
    model = CostModel(SPACE, batch_size=8)
    for arch in _archs(3, seed=2):
        sub = extract_subnet(supernet, arch).train()
        saved = measure_saved_activations(sub, torch.randn(8, 3, arch.r, arch.r))
        params = sum(p.numel() for p in sub.parameters())
        expected = (3 * 4 * params + saved) / 2**20  # weights + grads + momentum + saved activations
        assert model.cost(arch).train_memory_mb == pytest.approx(expected, rel=0.005)


def test_batch_equals_single_queries_and_unit_breakdown(model):
    archs = _archs(20, seed=3)
    out = model.batch(archs)
    assert set(out) == {"macs_m", "params_m", "peak_memory_mb", "train_memory_mb", "latency_ms", "energy_mj"}
    for i, arch in enumerate(archs):
        c = model.cost(arch)
        assert isinstance(c, Cost) and c.flops_m == 2 * c.macs_m
        assert c.macs_m == pytest.approx(out["macs_m"][i]) and c.train_memory_mb == pytest.approx(out["train_memory_mb"][i])
        assert math.isnan(c.latency_ms) and math.isnan(c.energy_mj)  # no profile
        rows = model.units(arch)
        assert sum(r["macs"] for r in rows) / 1e6 == pytest.approx(c.macs_m)
        assert max(r["peak_bytes"] for r in rows) <= c.peak_memory_mb * 2**20
    assert model.batch([])["macs_m"].shape == (0,)


def test_roofline_latency_and_energy_by_hand():
    prof = DeviceProfile(name="t", throughput_gmacs=2.0, mem_bandwidth_gbs=1.0, layer_overhead_us=100,
                         energy_pj_per_mac=10, energy_pj_per_dram_byte=5)
    spec = arch_units(SPACE, SPACE.smallest())[0][1]  # stem conv 3 -> 8, 3x3, 24 px
    macs = 8 * 3 * 9 * 24 * 24
    nbytes = 4 * (3 * 24 * 24 + 8 * 24 * 24 + 8 * 3 * 9)
    expected = max(macs / 2e9, nbytes / 1e9) * 1e3 + 0.1
    assert roofline_latency_ms(spec, prof) == pytest.approx(expected)
    m = CostModel(SPACE, prof)
    small, large = m.cost(SPACE.smallest()), m.cost(SPACE.largest())
    assert 0 < small.latency_ms < large.latency_ms and 0 < small.energy_mj < large.energy_mj
    rows = m.units(SPACE.smallest())
    assert sum(r["latency_ms"] for r in rows) == pytest.approx(small.latency_ms)
    pj = sum(r["spec"].macs() * 10 + sum(b for _, b in r["spec"].op_bytes()) * 5 for r in rows)
    assert small.energy_mj == pytest.approx(pj * 1e-9)
    power = DeviceProfile(name="p", throughput_gmacs=2.0, mem_bandwidth_gbs=1.0, avg_power_w=3.0)
    c = CostModel(SPACE, power).cost(SPACE.smallest())
    assert c.energy_mj == pytest.approx(3.0 * c.latency_ms)


def test_budget_checks_and_violations():
    prof = DeviceProfile(name="t", throughput_gmacs=2.0, mem_bandwidth_gbs=1.0, avg_power_w=2.0,
                         epoch_samples=100, budgets={"macs_m": 1.0, "latency_ms": 1e6, "energy_per_epoch_j": 1e-9})
    m = CostModel(SPACE, prof)
    c = m.cost(SPACE.largest())
    checks = {b.budget: b for b in check_budgets(c, prof)}
    assert not checks["macs_m"].passed and checks["macs_m"].margin < 0
    assert checks["latency_ms"].passed and checks["latency_ms"].margin > 0
    assert checks["energy_per_epoch_j"].value == pytest.approx(3 * c.energy_mj * 100 / 1000)
    msgs = m.violations(c)
    assert len(msgs) == 2 and msgs[0].startswith("macs_m: ") and "> budget 1" in msgs[0]
    assert list(m.feasible([SPACE.largest()])) == [False]


def test_archs_outside_the_space_are_user_errors(model):
    bad = ArchConfig(ks=(4,) * SPACE.n_blocks, e=(3,) * SPACE.n_blocks, d=(2,) * 5, r=32)
    with pytest.raises(UserInputError, match="ks"):
        model.cost(bad)
    with pytest.raises(UserInputError, match="r"):
        model.cost(ArchConfig(ks=(3,) * 20, e=(3,) * 20, d=(2,) * 5, r=40))


def test_measured_latency_lut_is_used_by_the_profile(tmp_path):
    space = SearchSpace(width_mult=0.25, ks_choices=(3,), e_choices=(3,), d_choices=(2,), resolutions=(24,))
    specs = [s for _, s in arch_units(space, space.smallest())]
    lut_path = tmp_path / "lut.yaml"
    entries = build_latency_lut(specs, lut_path, threads=1, warmup=1, repeats=3, progress=False)
    assert len(entries) == len({s.key for s in specs}) and all(v > 0 for v in entries.values())
    doc = yaml.safe_load(lut_path.read_text())
    assert doc["threads"] == 1 and doc["statistic"] == "median"
    prof_path = tmp_path / "dev.yaml"
    prof_path.write_text(yaml.safe_dump({"name": "dev", "throughput_gmacs": 1.0, "mem_bandwidth_gbs": 1.0,
                                         "latency_lut": "lut.yaml"}))  # relative to the profile file
    from rafl.search.profile import load_profile

    model = CostModel(space, load_profile(prof_path))
    expected = sum(entries[s.key] for s in specs)
    assert model.cost(space.smallest()).latency_ms == pytest.approx(expected)
    # a space the LUT was not built for: one clear error naming the LUT
    with pytest.raises(UserInputError, match="rebuild"):
        CostModel(SearchSpace(width_mult=0.5, ks_choices=(3,), e_choices=(3,), d_choices=(2,), resolutions=(24,)),
                  load_profile(prof_path))
    lut_path.write_text("format: something-else\n")
    with pytest.raises(UserInputError, match="not a latency LUT"):
        CostModel(space, load_profile(prof_path))


def test_a_missing_or_self_referencing_latency_lut_names_the_profile_and_the_resolved_path(tmp_path):
    """``latency_lut: nolut.yaml`` in prof/nolut.yaml resolves (against the profile's folder) to the
    profile itself: the error said "prof/nolut.yaml: not a latency LUT", naming neither the setting
    nor the path it resolved to; a missing LUT did not name the profile."""
    from rafl.search.profile import load_profile

    space = SearchSpace(width_mult=0.25, ks_choices=(3,), e_choices=(3,), d_choices=(2,), resolutions=(24,))
    prof_dir = tmp_path / "prof"
    prof_dir.mkdir()
    prof_path = prof_dir / "nolut.yaml"
    for value, problem in (("missing.yaml", "no such file"), ("nolut.yaml", "is this profile itself")):
        prof_path.write_text(yaml.safe_dump({"name": "dev", "throughput_gmacs": 1.0, "mem_bandwidth_gbs": 1.0,
                                             "latency_lut": value}))
        with pytest.raises(UserInputError) as err:
            CostModel(space, load_profile(prof_path))
        resolved = (prof_dir / value).resolve()
        assert str(err.value).startswith(f"{prof_path}: latency_lut: {value} (resolved to {resolved}): {problem}")
