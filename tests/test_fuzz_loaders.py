"""Fuzzing every loader of a file or blob rafl reads: each hostile or corrupted input is parsed, or
raises exactly one :class:`UserInputError` (one line, bounded), without hanging or blowing up memory.

Loaders: device profile, arch file, run config, partition JSON, latency LUT, supernet checkpoint
(``supernet.json`` and its weights), a client upload (payload blob) and a stored client state.
Inputs start from a real file of each kind and are mutated by hypothesis: byte edits, a value
replaced by a hostile one (wrong type, huge integer, NaN/Inf, a long string, deep nesting) and
hostile YAML snippets (alias bombs, recursive aliases, 10**5-digit integers, Python tags).

Each example runs under a hang guard (``signal.alarm``, far above a normal parse, not a timing
assertion) and a memory bound (``tracemalloc`` peak of Python allocations). The number of
examples per loader is ``RAFL_FUZZ_EXAMPLES`` (default 25; the reliability bench runs more),
deterministic (``derandomize``).
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rafl.errors import UserInputError

EXAMPLES = int(os.environ.get("RAFL_FUZZ_EXAMPLES", "25"))
#: a parse that takes this long is a hang (normal ones take milliseconds)
HANG_S = 60
#: peak Python memory of one load
MAX_PEAK_MB = 256
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

HOSTILE_VALUES = [True, None, "", "x" * 50_000, -1, 0, 2**64, 10**60, 1e308, float("inf"), float("nan"), [], {},
                  [1, "a", None], {"a": {"b": {"c": []}}}, "../../../etc/passwd"]
HOSTILE_YAML = [
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
    "f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\ng: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\n"
    "h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\ni: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]\n",
    "&a [*a]\n", "name: &n [*n]\n", "[" * 3000 + "]" * 3000, "{a: " * 2000 + "1" + "}" * 2000,
    "name: " + "9" * 100_000 + "\n", "name: !!python/object/apply:os.system [ls]\n", "x: !!binary AAAA\n",
    "name: .inf\n", "name: .nan\n", "- - - - - - - - - - - -\n" * 50, "? [a, b]\n: c\n", "<<: 5\n", "\t\x00\x1b",
    "a: 1\na: 2\n", "%YAML 1.1\n---\n...\n---\nb: 2\n",
]


def _guarded(load, *args):
    """``load(*args)``; returns "parsed" or "rejected" (one UserInputError); anything else raises."""
    def hang(signum, frame):
        raise TimeoutError(f"the loader ran more than {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    tracemalloc.start()
    try:
        load(*args)
        outcome = "parsed"
    except UserInputError as err:
        text = str(err)
        assert "\n" not in text and len(text) < 2000, text[:3000]
        outcome = "rejected"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert peak < MAX_PEAK_MB * 2**20, f"peak {peak / 2**20:.0f} MB"
    return outcome


# ---------------------------------------------------------------------- mutations
def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            yield from _paths(v, (*prefix, i))


def _replace(obj, path, value):
    if not path:
        return value
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[path[0]] = _replace(out[path[0]], path[1:], value)
    return out


@st.composite
def mutated(draw, text: str, obj, dump):
    """A mutation of the document ``text`` (parsed: ``obj``; ``dump`` writes a value back)."""
    kind = draw(st.sampled_from(["value", "value", "bytes", "snippet", "truncate"]))
    if kind == "value":
        paths = list(_paths(obj))
        path = paths[draw(st.integers(0, len(paths) - 1))]
        value = draw(st.sampled_from(HOSTILE_VALUES) | st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
            max_leaves=20))
        if draw(st.booleans()) and path:  # or delete the key
            parent = copy.deepcopy(obj)
            node = parent
            for p in path[:-1]:
                node = node[p]
            if isinstance(node, dict):
                node.pop(path[-1], None)
                return dump(parent)
        return dump(_replace(obj, path, value))
    if kind == "snippet":
        snippet = draw(st.sampled_from(HOSTILE_YAML))
        where = draw(st.integers(0, len(text)))
        return snippet if draw(st.booleans()) else text[:where] + snippet + text[where:]
    if kind == "truncate":
        return text[:draw(st.integers(0, len(text)))]
    rng = random.Random(draw(st.integers(0, 2**32)))
    chars = list(text)
    for _ in range(draw(st.integers(1, 8))):
        i = rng.randrange(len(chars) + 1)
        op = rng.choice(["put", "insert", "delete"])
        c = rng.choice("[]{}:&*!-,'\"\n #|>%@`.9e\t\\")
        if op == "put" and i < len(chars):
            chars[i] = c
        elif op == "insert":
            chars.insert(i, c * rng.choice((1, 1, 2, 50)))
        elif chars:
            del chars[i:i + rng.randrange(1, 20)]
    return "".join(chars)


def _yaml_dump(obj):
    return yaml.safe_dump(obj, sort_keys=False, allow_unicode=True)


def _json_dump(obj):
    return json.dumps(obj)


# ---------------------------------------------------------------------- the loaders' seeds
ROOT = Path(__file__).resolve().parents[1]
PROFILE = (ROOT / "profiles" / "pi4.yaml").read_text()
RUN_CONFIG = ("seed: 3\nname: fuzz\ndata: {dataset: digits, limit_per_class: 10}\npartition: {scheme: dirichlet, "
              "alpha: 0.5}\nclients: {n: 4, profiles: [pi4, phone]}\nalgorithm: {name: fedavg, lr: 0.05}\n"
              "engine: {rounds: 2, aggregation: trimmed_mean, min_valid_uploads: 1}\n")
ARCH = "ks: [3, 3, 3, 3, 3]\ne: [3, 3, 3, 3, 3]\nd: [1, 1, 1, 1, 1]\nr: 16\n"


def _space():
    from rafl.supernet import SearchSpace

    return SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10, d_choices=(1,), ks_choices=(3,),
                       e_choices=(3,))


def _lut_text():
    from rafl.search.latency import LUT_FORMAT

    return yaml.safe_dump({"format": LUT_FORMAT, "device": "pi4", "entries": {"conv3x3_s1_c8_r16": 0.12,
                                                                              "mbconv_k3_e3_c8_r16": 0.4}})


def _partition_text():
    from rafl.data import make_partition

    labels = np.repeat(np.arange(4), 10)
    return make_partition(labels, "dirichlet", 3, 0, alpha=1.0, min_samples=3, public_fraction=0.2)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", errors="surrogatepass") if isinstance(text, str) else path.write_bytes(text)
    return path


def _supernet_dir(out: Path) -> Path:
    from rafl.supernet import build_supernet
    from rafl.supernet.checkpoint import save_supernet

    torch.manual_seed(0)
    save_supernet(out, build_supernet(_space()), config={"public_fraction": 0.3, "public_seed": 0},
                  metrics={"acc": 0.5})
    return out


def loader_cases(folder: Path) -> dict:
    """``name -> (seed text, parsed seed, dump, file name, load(path))`` of every text loader, with
    what they need written under ``folder`` (also used by ``bench/reliability.py``)."""
    from rafl.data import Partition
    from rafl.federation.run_config import load_run_config
    from rafl.search.latency import load_latency_lut
    from rafl.search.profile import load_profile
    from rafl.supernet import ArchConfig
    from rafl.supernet.checkpoint import META_NAME, load_meta, load_supernet

    folder.mkdir(parents=True, exist_ok=True)
    _partition_text().save(folder / "partition-seed.json")
    sn = _supernet_dir(folder / "supernet")
    meta_seed = (sn / META_NAME).read_text()

    def supernet(path):
        load_meta(path.parent)
        load_supernet(path.parent)

    part = (folder / "partition-seed.json").read_text()
    lut = _lut_text()
    return {
        "profile": (PROFILE, yaml.safe_load(PROFILE), _yaml_dump, "case.yaml", load_profile),
        "arch": (ARCH, yaml.safe_load(ARCH), _yaml_dump, "case.yaml", lambda p: ArchConfig.load(p, _space())),
        "run_config": (RUN_CONFIG, yaml.safe_load(RUN_CONFIG), _yaml_dump, "case.yaml", load_run_config),
        "latency_lut": (lut, yaml.safe_load(lut), _yaml_dump, "case.yaml", load_latency_lut),
        "partition": (part, json.loads(part), _json_dump, "case.json", lambda p: Partition.load(p, 40)),
        "supernet_json": (meta_seed, json.loads(meta_seed), _json_dump, f"supernet/{META_NAME}", supernet),
    }


@pytest.mark.parametrize("loader", ["profile", "arch", "run_config", "latency_lut", "partition", "supernet_json"])
def test_every_text_loader_parses_or_rejects_with_one_error(loader, tmp_path):
    seed, obj, dump, name, load = loader_cases(tmp_path)[loader]
    assert _guarded(load, _write(tmp_path, name, seed)) == "parsed"

    @FUZZ
    @given(mutated(seed, obj, dump))
    def run(text):
        _guarded(load, _write(tmp_path, name, text))

    run()


@st.composite
def mutated_blob(draw, blob: bytes):
    data = bytearray(blob)
    kind = draw(st.sampled_from(["flip", "truncate", "header"]))
    if kind == "truncate":
        return bytes(data[:draw(st.integers(0, len(data)))])
    if kind == "header":  # a hostile header length / header text
        n = draw(st.sampled_from([0, 1, 7, 2**31, 2**63 - 1, len(data) * 10]))
        return n.to_bytes(8, "little") + bytes(data[8:])
    rng = random.Random(draw(st.integers(0, 2**32)))
    header = int.from_bytes(data[:8], "little") + 8
    for _ in range(draw(st.integers(1, 16))):
        i = rng.randrange(min(len(data), header + 64))  # mostly the JSON header, some tensor bytes
        data[i] = rng.randrange(256)
    return bytes(data)


def blob_seeds() -> tuple[bytes, bytes]:
    """A payload blob and a client-state blob (also used by ``bench/reliability.py``)."""
    from rafl.federation.payload import Payload
    from rafl.federation.store import state_to_bytes

    payload = Payload({"w": torch.randn(4, 3), "n": torch.tensor([1, 2], dtype=torch.int64)},
                      {"n_samples": 12, "ids": [0, 3]}).to_bytes()
    return payload, state_to_bytes({"model": {"w": torch.randn(3)}, "opt": [1, 2.5, None, "x"]})


def test_payload_and_client_state_blobs_parse_or_reject_with_one_error(tmp_path):
    from rafl.federation.payload import Payload
    from rafl.federation.store import load_state

    payload, state = blob_seeds()

    @FUZZ
    @given(mutated_blob(payload), mutated_blob(state))
    def run(p, s):
        _guarded(Payload.from_bytes, p, "client 1")
        _guarded(load_state, _write(tmp_path, "0000001.r00001.st", s))

    run()
