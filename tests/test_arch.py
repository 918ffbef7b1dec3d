import re

import numpy as np
import pytest

from rafl.errors import UserInputError
from rafl.supernet.arch import ArchConfig, SearchSpace


@pytest.fixture
def space():
    return SearchSpace()


def test_sizes(space):
    assert space.n_blocks == 20
    assert space.num_subnets() == (9**2 + 9**3 + 9**4) ** 5 * 3
    assert space.encoding_size == 20 * 6 + 3
    assert space.smallest().validate(space) and space.largest().validate(space)


def test_roundtrips(space, tmp_path):
    rng = np.random.default_rng(0)
    for _ in range(20):
        arch = space.sample(rng)
        assert ArchConfig.from_string(arch.to_string(), space) == arch
        for suffix in (".yaml", ".json"):
            path = tmp_path / f"a{suffix}"
            arch.save(path)
            assert ArchConfig.load(path, space) == arch


def test_validate_names_field(space):
    arch = space.largest()
    bad = ArchConfig(ks=arch.ks[:-1] + (4,), e=arch.e, d=arch.d, r=arch.r)
    with pytest.raises(UserInputError, match=r"ks\[19\].*allowed: one of 3, 5, 7"):
        bad.validate(space)
    with pytest.raises(UserInputError, match=r"r: is 224"):
        ArchConfig(arch.ks, arch.e, arch.d, 224).validate(space)
    other = SearchSpace(d_choices=(2, 3, 4, 5))
    with pytest.raises(UserInputError, match="block entries"):
        other.largest().validate(space)


def test_load_errors(tmp_path, space):
    p = tmp_path / "x.yaml"
    p.write_text("ks: [3]\ne: [3]\n")
    with pytest.raises(UserInputError, match="missing key"):
        ArchConfig.load(p, space)
    with pytest.raises(UserInputError, match="no such file"):
        ArchConfig.load(tmp_path / "nope.yaml", space)


def test_encoding_ignores_inactive_blocks(space):
    a = space.smallest()
    ks = list(a.ks)
    ks[3] = 7  # slot 3 is inactive at depth 2
    b = ArchConfig(tuple(ks), a.e, a.d, a.r)
    assert np.array_equal(a.encode(space), b.encode(space))
    assert b.canonical(space) == a
    assert a.encode(space).sum() == 10 * 2 + 1


def test_evolution_ops_deterministic(space):
    a, b = space.sample(np.random.default_rng(1)), space.sample(np.random.default_rng(2))
    m1 = a.mutate(space, np.random.default_rng(3))
    m2 = a.mutate(space, np.random.default_rng(3))
    assert m1 == m2
    m1.validate(space)
    c = a.crossover(b, space, np.random.default_rng(4))
    c.validate(space)
    for i in c.active_blocks(space):
        assert c.ks[i] in (a.ks[i], b.ks[i], 3)


@pytest.mark.parametrize("edit, field", [(lambda a: a.update(r=32.5), "r: is 32.5, allowed: an integer"),
                                         (lambda a: a["d"].__setitem__(0, True), "d[0]: is True (YAML reads"),
                                         (lambda a: a["ks"].__setitem__(0, "3"), "ks[0]: is '3', allowed: an integer")])
def test_arch_values_must_be_integers_not_floats_bools_or_strings(edit, field):
    space = SearchSpace(width_mult=0.25)
    data = {k: list(v) if isinstance(v, list | tuple) else v for k, v in space.smallest().to_dict().items()}
    edit(data)
    with pytest.raises(UserInputError, match=f"^arch.yaml: {re.escape(field)}"):
        ArchConfig.from_dict(data, source="arch.yaml")
