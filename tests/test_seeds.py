"""The run's seed tree (rafl/seeds.py): its leaves reproduce the streams shipped artefacts were
made with, no two consumers share a stream beyond KEPT_SHARED, and no module draws outside it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from rafl import seeds
from rafl.data.partition import carve_global_test, carve_public_pool, make_partition
from rafl.federation.new_clients import held_out_clients
from rafl.seeds import KEPT_SHARED, LEAVES, NUMPY, TORCH, SeedTree
from rafl.supernet.server_data import calibration_sample

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [(0, 0), (1, 1), (3, 7), (12345, 0), (2**40 + 3, 5)]  # (seed, public_seed)

#: how each stream was drawn before the tree (numpy.random.default_rng(x) seeds SeedSequence(x));
#: root -> the SeedSequence or int seed
BEFORE = {
    "pool": lambda s: np.random.SeedSequence(s),
    "global-test": lambda s: np.random.SeedSequence([s, 5_0_0_5]),
    "server-val": lambda s: np.random.SeedSequence([s, 90_10]),
    "server-test": lambda s: np.random.SeedSequence([s, 7357]),
    "partition": lambda s: np.random.SeedSequence(s).spawn(2)[0],
    "client-split": lambda s: np.random.SeedSequence(s).spawn(2)[1],
    "held-out": lambda s: np.random.SeedSequence([s, 56]),
    "search-split": lambda s: np.random.SeedSequence([s, 5]),
    "search-evolution": lambda s: np.random.SeedSequence(s),
    "largest-feasible": lambda s: np.random.SeedSequence(s),
    "predictor-samples": lambda s: np.random.SeedSequence(s),
    "predictor-folds": lambda s: np.random.SeedSequence(s),
    "predictor-init": lambda s: s,
    "measurement-halves": lambda s: np.random.SeedSequence(0),
    "calibration": lambda s: np.random.SeedSequence([0, 8_4242]),
    "supernet-weights": lambda s: s,
    "supernet-numpy-global": lambda s: s % 2**32,
    "supernet-python-random": lambda s: s,
    "supernet-arch": lambda s: np.random.SeedSequence([s, 1]),
    "supernet-loader": lambda s: s + 2,
    "supernet-calibration": lambda s: np.random.SeedSequence([s, 8_4242]),
}
#: the leaves given a derivation of their own: they drew a stream another consumer drew too
NEW = {"search-probe", "latency-archs", "latency-layers", "export-input", "profile-weights"}


def _state(ss: np.random.SeedSequence) -> tuple[int, ...]:
    return tuple(int(v) for v in ss.generate_state(4, np.uint64))


def test_every_leaf_is_either_kept_or_new():
    assert set(BEFORE) | NEW | {"engine"} == set(LEAVES) and not set(BEFORE) & NEW


@pytest.mark.parametrize("seed, public_seed", SEEDS)
def test_the_kept_leaves_draw_the_streams_of_before(seed, public_seed):
    for name, before in BEFORE.items():
        leaf = LEAVES[name]
        root = public_seed if leaf.root == seeds.PUBLIC_SEED else seed
        if leaf.family == NUMPY:
            assert _state(seeds.sequence(name, root)) == _state(before(root)), name
            assert seeds.generator(name, root).integers(0, 2**62, 4).tolist() == \
                np.random.default_rng(before(root)).integers(0, 2**62, 4).tolist(), name
        else:
            assert seeds.int_seed(name, root) == before(root), name


def test_the_shipped_draws_are_pinned():
    """Numbers drawn before the tree: pools, global test sets, a partition, the calibration
    images, the held-out clients and the engine's seeds."""
    labels = np.repeat(np.arange(4), 25)
    origin = np.array(["train"] * 80 + ["test"] * 20)[np.random.default_rng(123).permutation(100)]
    assert carve_public_pool(labels, 0.2, 0, origin)[:6].tolist() == [5, 12, 20, 22, 29, 33]
    assert carve_public_pool(labels, 0.2, 7, origin)[:6].tolist() == [4, 10, 12, 15, 25, 29]
    assert carve_global_test(labels, 2, 0, origin).tolist() == [17, 19, 31, 35, 58, 68, 91, 96]
    assert carve_global_test(labels, 2, 7, origin).tolist() == [17, 19, 36, 39, 71, 73, 91, 96]
    p = make_partition(labels, "dirichlet", 3, 5, alpha=0.5, min_samples=5, public_fraction=0.2, public_seed=0,
                       origin=origin)
    assert [c.train[:4].tolist() for c in p.clients] == [[2, 6, 7, 9], [13, 14, 23, 54], [1, 3, 4, 10]]
    assert [c.test.tolist() for c in p.clients] == [[11, 45, 67], [69, 90], [18, 27, 63, 96]]
    assert calibration_sample(np.arange(50), 5).tolist() == [21, 40, 41, 2, 26]
    assert calibration_sample(np.arange(50), 5, 3).tolist() == [28, 26, 32, 36, 47]
    assert held_out_clients(["a", "b"] * 6, 4, 0) == [1, 2, 3, 6]
    assert held_out_clients(["a", "b"] * 6, 4, 9) == [1, 4, 6, 9]
    t = SeedTree(0)
    assert (t.sampling(0), t.server(3), t.client(2, 5)) == (1317536309490288386, 6931203489060459394,
                                                           5857718211143936989)
    assert SeedTree(11).client(1, 0) == 5491339978613755236


def _streams(seed: int, public_seed: int) -> dict[tuple[str, object], list[str]]:
    """(family, state) -> the consumers drawing it: every leaf, and the engine's nodes of rounds
    0..3 for clients 0..4 (plus a held-out client's)."""
    out: dict[tuple[str, object], list[str]] = {}
    for name, leaf in LEAVES.items():
        if name == "engine":
            continue
        root = public_seed if leaf.root == seeds.PUBLIC_SEED else seed
        key = (NUMPY, _state(leaf.sequence(root))) if leaf.family == NUMPY else (leaf.family, leaf.int_seed(root))
        out.setdefault(key, []).append(name)
    t = SeedTree(seed)
    for rnd in range(4):  # sampling seeds a NumPy generator; server and client seeds torch's
        out.setdefault((NUMPY, _state(np.random.SeedSequence(t.sampling(rnd)))), []).append(f"engine sampling {rnd}")
        out.setdefault((TORCH, t.server(rnd)), []).append(f"engine server {rnd}")
        for cid in (*range(5), 9):
            out.setdefault((TORCH, t.client(rnd, cid)), []).append(f"engine client {rnd}.{cid}")
    return out


@pytest.mark.parametrize("seed, public_seed", SEEDS)
def test_no_two_consumers_share_a_stream_beyond_the_kept_ones(seed, public_seed):
    for names in _streams(seed, public_seed).values():
        if len(names) > 1:
            assert any(set(names) <= group for group in KEPT_SHARED), names


def test_the_kept_groups_do_share_at_seed_0():
    """KEPT_SHARED names no pair that does not collide (each group is one stream for seed 0)."""
    shared = [set(names) for names in _streams(0, 0).values() if len(names) > 1]
    assert sorted(map(sorted, shared)) == sorted(map(sorted, KEPT_SHARED))
    # with a public seed of its own and a seed other than 0, the pool and the halves draw alone
    alone = {n for names in _streams(3, 7).values() if len(names) == 1 for n in names}
    assert {"pool", "measurement-halves", "calibration", "supernet-calibration"} <= alone


def test_the_new_leaves_differ_from_every_stream_of_before():
    for seed, public_seed in SEEDS:
        before = {_state(f(r)) if isinstance(f(r), np.random.SeedSequence) else ("int", f(r))
                  for f in BEFORE.values() for r in (seed, public_seed)}
        for name in NEW:
            leaf = LEAVES[name]
            got = _state(leaf.sequence(seed)) if leaf.family == NUMPY else ("int", leaf.int_seed(seed))
            assert got not in before, name


def test_an_unknown_leaf_names_the_leaves():
    with pytest.raises(KeyError, match="no seed-tree leaf 'pools'; leaves: pool, global-test"):
        seeds.generator("pools", 0)


def test_no_module_draws_outside_the_tree():
    """Only rafl/seeds.py builds a SeedSequence or a NumPy generator from a seed, or seeds NumPy's
    or Python's global generator; torch is seeded with a leaf's or an engine node's seed."""
    flat = re.compile(r"default_rng\(|SeedSequence\(|np\.random\.seed\(|(?<![\w.])random\.seed\(")
    raw_torch = re.compile(r"manual_seed\((?:\d|seed\)|config\.seed|cfg\.seed)")
    found = []
    for path in sorted((ROOT / "rafl").rglob("*.py")):
        if path == ROOT / "rafl" / "seeds.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if flat.search(code) and "seeds." not in code or raw_torch.search(code):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_design_doc_lists_every_leaf_with_its_derivation():
    text = (ROOT / "docs" / "design.md").read_text()
    for name, leaf in LEAVES.items():
        if name == "engine":
            assert "| `engine` |" in text
            continue
        assert re.search(rf"^\| `{re.escape(name)}` \| .* \| `{re.escape(leaf.derivation())}` \|", text, re.M), name


def test_derivations_read_as_the_code_draws():
    assert LEAVES["pool"].derivation() == "SeedSequence(public_seed)"
    assert LEAVES["partition"].derivation() == "SeedSequence(seed, spawn_key=(0,))"
    assert LEAVES["global-test"].derivation() == "SeedSequence([public_seed, 5005])"
    assert LEAVES["supernet-loader"].derivation() == "seed + 2"
    assert LEAVES["supernet-numpy-global"].derivation() == "seed % 2**32"
    assert LEAVES["export-input"].derivation() == "63 bits of SeedSequence([0, 37])"
