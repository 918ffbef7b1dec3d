"""Partition invariants, public pool, per-client 8:1:1 splits, partition.json round trip, bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rafl.data import Partition, carve_public_pool, load_dataset, make_partition, split_client
from rafl.data.partition import MAX_DIRICHLET_TRIES
from rafl.errors import UserInputError


@pytest.fixture(scope="module")
def digits_labels() -> np.ndarray:
    return load_dataset("digits").labels.numpy()


def _all_sets(part: Partition) -> list[np.ndarray]:
    return [part.public] + [a for c in part.clients for a in (c.train, c.val, c.test)]


def _assert_disjoint(part: Partition) -> None:
    allidx = np.concatenate(_all_sets(part))
    assert len(np.unique(allidx)) == len(allidx)


def _same(a: Partition, b: Partition) -> bool:
    if len(a.clients) != len(b.clients) or not np.array_equal(a.public, b.public):
        return False
    return all(np.array_equal(getattr(x, s), getattr(y, s)) for x, y in zip(a.clients, b.clients)
               for s in ("train", "val", "test"))


SCHEMES = [("iid", {}), ("pathological", {"k": 2}), ("dirichlet", {"alpha": 0.1}), ("dirichlet", {"alpha": 1.0}),
           ("balanced-dirichlet", {"alpha": 0.1}), ("balanced-dirichlet", {"alpha": 1.0})]


@pytest.mark.parametrize("scheme,kw", SCHEMES)
@pytest.mark.parametrize("public_fraction", [0.0, 0.3])
def test_disjoint_complete_deterministic(digits_labels, scheme, kw, public_fraction):
    y = digits_labels
    part = make_partition(y, scheme, 20, seed=3, public_fraction=public_fraction, **kw)
    assert part.n_clients == 20
    _assert_disjoint(part)
    # complete: every sample is either in the public pool or with exactly one client
    covered = np.sort(np.concatenate(_all_sets(part)))
    assert np.array_equal(covered, np.arange(len(y)))
    assert part.meta["unassigned"] == 0
    assert np.array_equal(part.public, carve_public_pool(y, public_fraction, 0))
    # same seed -> same partition; another seed -> another one
    assert _same(part, make_partition(y, scheme, 20, seed=3, public_fraction=public_fraction, **kw))
    assert not _same(part, make_partition(y, scheme, 20, seed=4, public_fraction=public_fraction, **kw))
    for c in part.clients:
        for s in (c.train, c.val, c.test):
            assert s.dtype == np.int64 and np.all(np.diff(s) > 0)


@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_pathological_exactly_k_classes(digits_labels, k):
    part = make_partition(digits_labels, "pathological", 20, seed=0, k=k)
    held = (part.class_counts(digits_labels) > 0).sum(axis=1)
    assert held.tolist() == [k] * 20
    # each class is held by floor or ceil of n*k/C clients
    holders = (part.class_counts(digits_labels) > 0).sum(axis=0)
    assert holders.max() - holders.min() <= 1 and holders.sum() == 20 * k


def test_pathological_10_of_100_synthetic_cifar100_labels():
    y = np.repeat(np.arange(100), 60)  # CIFAR-100 shape: 100 classes
    part = make_partition(y, "pathological", 20, seed=1, k=10)
    counts = part.class_counts(y)
    assert counts.shape == (20, 100)
    assert ((counts > 0).sum(axis=1) == 10).all()
    assert counts.sum() == len(y) and part.meta["unassigned"] == 0


def test_pathological_fewer_slots_than_classes_leaves_classes_unassigned(digits_labels):
    part = make_partition(digits_labels, "pathological", 3, seed=0, k=2)  # 6 < 10 classes
    assert ((part.class_counts(digits_labels) > 0).sum(axis=1) == 2).all()
    assert part.meta["unassigned"] == len(digits_labels) - sum(c.n_samples for c in part.clients) > 0
    _assert_disjoint(part)


def test_dirichlet_min_samples_and_skew(digits_labels):
    part = make_partition(digits_labels, "dirichlet", 20, seed=0, alpha=0.1, min_samples=25)
    sizes = [c.n_samples for c in part.clients]
    assert min(sizes) >= 25
    held = (part.class_counts(digits_labels) > 0).sum(axis=1)
    assert held.mean() < 7  # alpha=0.1 is strongly label-skewed
    iid_held = (make_partition(digits_labels, "iid", 20, seed=0).class_counts(digits_labels) > 0).sum(axis=1)
    assert (iid_held == 10).all()


def test_dirichlet_gives_up_after_bounded_tries(digits_labels):
    with pytest.raises(UserInputError, match=rf"in {MAX_DIRICHLET_TRIES} tries.*raise --alpha"):
        make_partition(digits_labels, "dirichlet", 100, seed=0, alpha=0.01, min_samples=17)


def test_iid_sizes_balanced(digits_labels):
    sizes = [c.n_samples for c in make_partition(digits_labels, "iid", 7, seed=0).clients]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(digits_labels)


def test_natural_one_client_per_writer():
    rng = np.random.default_rng(0)
    writers = np.repeat([f"w{i:02d}" for i in range(12)], [5, 30, 30, 12, 40, 9, 20, 20, 15, 25, 11, 3])
    labels = rng.integers(0, 62, size=len(writers))
    part = make_partition(labels, "natural", None, seed=0, writers=writers, min_samples=10)
    eligible = sorted(w for w in np.unique(writers) if (writers == w).sum() >= 10)
    assert part.meta["writers"] == eligible
    for c, w in zip(part.clients, part.meta["writers"]):
        assert set(writers[c.all()]) == {w}
        assert c.n_samples == (writers == w).sum()
    sub = make_partition(labels, "natural", 4, seed=5, writers=writers, min_samples=10)
    assert len(sub.clients) == 4 and set(sub.meta["writers"]) <= set(eligible)
    assert _same(sub, make_partition(labels, "natural", 4, seed=5, writers=writers, min_samples=10))
    with pytest.raises(UserInputError, match="writers"):
        make_partition(labels, "natural", len(eligible) + 1, seed=0, writers=writers, min_samples=10)
    with pytest.raises(UserInputError, match="writer ids"):
        make_partition(labels, "natural", 3, seed=0)


def test_split_ratios_and_stratification(digits_labels):
    part = make_partition(digits_labels, "iid", 10, seed=0)
    tr = sum(len(c.train) for c in part.clients)
    va = sum(len(c.val) for c in part.clients)
    te = sum(len(c.test) for c in part.clients)
    n = tr + va + te
    assert abs(tr / n - 0.8) < 0.01 and abs(va / n - 0.1) < 0.01 and abs(te / n - 0.1) < 0.01
    for c in part.clients:  # stratified: every class of a ~180-sample iid client is in its test split
        train_classes = set(digits_labels[c.train])
        assert set(digits_labels[c.test]) == train_classes == set(range(10))


def test_split_client_small_and_remainder():
    labels = np.array([0] * 10 + [1] * 2 + [2] * 1 + [3] * 7)
    cs = split_client(np.arange(len(labels)), labels, (0.8, 0.1, 0.1), np.random.default_rng(0))
    assert (len(cs.train), len(cs.val), len(cs.test)) == (16, 2, 2)
    assert np.array_equal(np.sort(np.concatenate([cs.train, cs.val, cs.test])), np.arange(len(labels)))
    # three samples -> 1/1/1; two -> all train
    three = split_client(np.array([4, 5, 6]), np.zeros(10, dtype=int))
    assert (len(three.train), len(three.val), len(three.test)) == (1, 1, 1)
    two = split_client(np.array([1, 2]), np.zeros(10, dtype=int))
    assert (len(two.train), len(two.val), len(two.test)) == (2, 0, 0)
    # every client with >= 3 samples gets >= 1 test sample
    y = np.random.default_rng(1).integers(0, 10, size=400)
    for n in range(3, 40):
        assert len(split_client(np.arange(n), y).test) >= 1
    with pytest.raises(UserInputError, match="split"):
        split_client(np.arange(5), labels, (0.5, 0.1, 0.1))


def test_carve_public_pool_stratified_deterministic(digits_labels):
    y = digits_labels
    pool = carve_public_pool(y, 0.3, seed=0)
    assert np.array_equal(pool, carve_public_pool(y, 0.3, seed=0))
    assert not np.array_equal(pool, carve_public_pool(y, 0.3, seed=1))
    assert pool.dtype == np.int64 and np.all(np.diff(pool) > 0)
    per_class = np.bincount(y[pool], minlength=10)
    expected = np.round(0.3 * np.bincount(y)).astype(int)
    assert np.array_equal(per_class, expected)
    assert len(carve_public_pool(y, 0.0)) == 0
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(UserInputError, match="public_fraction"):
            carve_public_pool(y, bad)


def test_partition_json_roundtrip_and_file_scheme(digits_labels, tmp_path):
    part = make_partition(digits_labels, "dirichlet", 8, seed=2, alpha=0.5, public_fraction=0.2, dataset="digits")
    path = tmp_path / "partition.json"
    part.save(path)
    obj = json.loads(path.read_text())
    assert obj["format"] == "rafl.partition" and obj["version"] == 1
    assert sorted(obj["clients"], key=int) == [str(i) for i in range(8)]
    assert set(obj["clients"]["0"]) == {"train", "val", "test"}
    assert obj["meta"]["n_samples"] == len(digits_labels) and obj["meta"]["dataset"] == "digits"
    loaded = Partition.load(path, n_samples=len(digits_labels))
    assert _same(part, loaded)
    via_scheme = make_partition(digits_labels, f"file:{path}", 3, seed=99)  # other args are ignored
    assert _same(part, via_scheme)
    assert np.array_equal(part.class_counts(digits_labels), loaded.class_counts(digits_labels))


@pytest.mark.parametrize("payload,match", [
    ("not json", "not valid JSON"),
    ('{"clients": {"0": {"train": [1, 2], "val": [2], "test": []}}}', "more than once"),
    ('{"clients": {"0": {"train": [1, 5000], "val": [], "test": []}}}', "allowed 0..1796"),
    ('{"clients": {"0": {"train": [-1], "val": [], "test": []}}}', "negative"),
    # below -2**63 (no int64 holds it) and above 2**63: one line, not an OverflowError
    ('{"clients": {"0": {"train": [-9223372036854775809], "val": [], "test": []}}}', "negative index"),
    ('{"clients": {"0": {"train": [1], "val": [], "test": [-99999999999999999999999]}}}', "negative index"),
    ('{"clients": {"0": {"train": [9223372036854775808], "val": [], "test": []}}}', "below 2\\*\\*62"),
    ('{"public": [-9223372036854775809], "clients": {"0": {"train": [1], "val": [], "test": []}}}', "public"),
    ('{"meta": {"seed": -9223372036854775809}, "clients": {"0": {"train": [1], "val": [], "test": []}}}',
     r"meta.seed: is .*allowed: an integer within"),
    ('{"meta": {"params": {"k": [1, 99999999999999999999]}}, "clients": {"0": {"train": [1]}}}',
     r"meta.params.k\[1\]"),
    ('{"clients": {"1": {"train": [1], "val": [], "test": []}}}', "client ids"),
    ('{"clients": {"0": {"train": [1.5], "val": [], "test": []}}}', "integer"),
    ('{"meta": {"n_samples": 10}, "clients": {"0": {"train": [1], "val": [], "test": []}}}', "n_samples"),
    ('{"format": "other", "clients": {"0": {"train": [1]}}}', "format"),
    ('{"clients": {}}', "non-empty"),
    # a client with nothing to train on: it failed only in round 1, naming neither file nor field
    ('{"clients": {"0": {"train": [1], "val": [], "test": [2]}, "1": {"train": [], "val": [], "test": [3]}}}',
     r"clients.1.train: is empty; allowed: at least one training sample per client"),
])
def test_partition_load_rejects_bad_files(digits_labels, tmp_path, payload, match):
    path = tmp_path / "partition.json"
    path.write_text(payload)
    with pytest.raises(UserInputError, match=match) as err:
        make_partition(digits_labels, f"file:{path}", 1, seed=0)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_partition_load_missing_file(digits_labels, tmp_path):
    with pytest.raises(UserInputError, match="not found"):
        make_partition(digits_labels, f"file:{tmp_path / 'nope.json'}", 1, seed=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"scheme": "shards", "n_clients": 5}, "allowed: one of iid, pathological, dirichlet, balanced-dirichlet, natural, file:PATH"),
    ({"scheme": "pathological", "n_clients": 5, "k": 11}, r"k: is 11, allowed: an integer 1..10"),
    ({"scheme": "pathological", "n_clients": 5, "k": 0}, r"k: is 0"),
    ({"scheme": "pathological", "n_clients": 5}, "k: is required"),
    ({"scheme": "dirichlet", "n_clients": 5, "alpha": 0.0}, "alpha: is 0.0, allowed"),
    ({"scheme": "dirichlet", "n_clients": 5, "alpha": -1.0}, "alpha: is -1.0"),
    ({"scheme": "dirichlet", "n_clients": 5}, "alpha: is required"),
    ({"scheme": "balanced-dirichlet", "n_clients": 5}, "alpha: is required for --partition balanced-dirichlet"),
    ({"scheme": "balanced-dirichlet", "n_clients": 5, "alpha": float("nan")}, "alpha: is nan, allowed"),
    ({"scheme": "balanced-dirichlet", "n_clients": 100, "alpha": 0.1, "min_samples": 18},
     r"min_samples: is 18, but 1797 samples over 100 equal clients give each 17; allowed: 1..17"),
    ({"scheme": "iid", "n_clients": 0}, "n_clients: is 0"),
    ({"scheme": "iid", "n_clients": -3}, "n_clients: is -3"),
    ({"scheme": "iid", "n_clients": 1798}, "n_clients: is 1798, but only 1797 samples"),
    ({"scheme": "iid", "n_clients": 1500, "public_fraction": 0.3}, "public_fraction: is 0.3: the server.s pool takes"),
    ({"scheme": "dirichlet", "n_clients": 200, "alpha": 1.0}, "200 clients x 10 samples"),
    ({"scheme": "iid", "n_clients": 5, "split": (0.8, 0.3, 0.1)}, "split"),
    ({"scheme": "iid", "n_clients": 5, "min_samples": 0}, "min_samples"),
])
def test_bad_inputs(digits_labels, kwargs, match):
    kwargs = {"seed": 0, **kwargs}
    with pytest.raises(UserInputError, match=match) as err:
        make_partition(digits_labels, **kwargs)
    assert "\n" not in str(err.value)


def test_dirichlet_with_a_tiny_alpha_draws_extreme_skew_not_an_even_spread():
    """alpha -> 0: every class on one client (the balancing rule used to fall back to an even spread
    of a class over all clients when its one-hot share landed on a full client)."""
    labels = np.repeat(np.arange(10), 50)
    part = make_partition(labels, "dirichlet", 5, 0, alpha=1e-9, min_samples=5, public_fraction=0.0)
    held = np.array([np.bincount(labels[np.concatenate([c.train, c.val, c.test])], minlength=10)
                     for c in part.clients])
    assert ((held > 0).sum(axis=0) == 1).all(), held  # each class wholly on one client
    assert held.sum() == 500


def test_a_public_pool_that_leaves_clients_too_little_is_named_with_the_fraction_it_allows(digits_labels):
    """The pool, not the clients, is what leaves fewer than clients x min_samples samples: the error
    names public_fraction and the largest fraction that leaves that many (a Dirichlet draw may still
    need a smaller one)."""
    with pytest.raises(UserInputError, match=r"public_fraction: is 0.9: the server's pool takes \d+ samples and "
                                             r"leaves \d+ to partition, fewer than 20 clients x min_samples 10 = 200; "
                                             r"allowed: a fraction in \[0, 0\.\d+\]") as err:
        make_partition(digits_labels, "dirichlet", 20, seed=0, alpha=0.5, min_samples=10, public_fraction=0.9)
    largest = float(err.value.message.rsplit(", ", 1)[1].rstrip("]"))
    part = make_partition(digits_labels, "iid", 20, seed=0, public_fraction=largest)   # the count is there
    assert sum(len(c.all()) for c in part.clients) >= 200
    with pytest.raises(UserInputError, match=r"fewer than one per client \(20 clients\)"):
        make_partition(digits_labels, "iid", 20, seed=0, public_fraction=0.995)
    with pytest.raises(UserInputError, match="lower --clients or --min-samples") as err:   # the clients' own limit
        make_partition(digits_labels, "dirichlet", 20, seed=0, alpha=0.5, min_samples=100)
    assert err.value.field == "min_samples"


@pytest.mark.parametrize("alpha", [0.05, 0.5])
def test_balanced_dirichlet_gives_equal_clients_every_sample_once(digits_labels, alpha):
    """Hsu et al. 2019's scheme: near-equal client sizes (floor or ceil of N/n, the first N mod n
    clients one larger), every non-pool sample with exactly one client, deterministic for the seed;
    where the per-class dirichlet scheme leaves a client a handful of samples."""
    y = digits_labels
    part = make_partition(y, "balanced-dirichlet", 100, seed=0, alpha=alpha, min_samples=17, public_fraction=0.0)
    sizes = np.array([c.n_samples for c in part.clients])
    assert sizes.tolist() == [18] * (len(y) % 100) + [17] * (100 - len(y) % 100)
    assert np.array_equal(np.sort(np.concatenate([c.all() for c in part.clients])), np.arange(len(y)))
    assert part.meta["params"] == {"alpha": alpha, "min_samples": 17} and part.meta["unassigned"] == 0
    assert _same(part, make_partition(y, "balanced-dirichlet", 100, seed=0, alpha=alpha, min_samples=17))
    # the per-class scheme at the same alpha: clients of very unequal size, or at 0.05 some client empty
    if alpha < 0.1:
        with pytest.raises(UserInputError, match="no Dirichlet.*>= 1 samples"):
            make_partition(y, "dirichlet", 100, seed=0, alpha=alpha, min_samples=1)
    else:
        per_class = make_partition(y, "dirichlet", 100, seed=0, alpha=alpha, min_samples=1)
        assert max(c.n_samples for c in per_class.clients) - min(c.n_samples for c in per_class.clients) > 5


def test_balanced_dirichlet_skew_follows_alpha(digits_labels):
    """Small alpha: a client's labels concentrate on few classes; large alpha: near the pool's class
    frequencies (every client holds about the same mixture as IID)."""
    y = digits_labels

    def top_share(alpha: float) -> float:
        cc = make_partition(y, "balanced-dirichlet", 20, seed=1, alpha=alpha).class_counts(y)
        return float((cc.max(axis=1) / cc.sum(axis=1)).mean())

    skewed, mixed, flat = top_share(0.05), top_share(1.0), top_share(1000.0)
    assert skewed > 0.6 > mixed > flat
    assert flat < 0.2                                       # about 1/10: the prior, as IID gives
    held = (make_partition(y, "balanced-dirichlet", 20, seed=1, alpha=0.05).class_counts(y) > 0).sum(axis=1)
    assert held.mean() < 5


def test_balanced_dirichlet_with_a_tiny_alpha_still_fills_every_client():
    """alpha -> 0: each client's mixture is one class; when its class is used up it takes the samples
    left (in proportion to the classes' counts), so every client is still filled to its size."""
    labels = np.repeat(np.arange(10), 50)
    part = make_partition(labels, "balanced-dirichlet", 7, 0, alpha=1e-9, min_samples=5)
    assert sorted(c.n_samples for c in part.clients) == [71] * 4 + [72] * 3
    assert part.meta["pool_draws"] > 0
    _assert_disjoint(part)
