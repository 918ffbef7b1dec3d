"""`rafl data`: the documented command, file: reuse, and every bad input (exit 2, one line, nothing written)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from rafl.cli import cli
from rafl.data import Partition, load_dataset, make_partition
from rafl.data.sources import cache_dir


@pytest.fixture(autouse=True)
def _no_default_data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("RAFL_DATA_ROOT", str(tmp_path / "no-data-here"))


def run(*args: str):
    return CliRunner().invoke(cli, ["data", *args], catch_exceptions=False)


def test_documented_command(tmp_path):
    out = tmp_path / "run"
    res = run("--dataset", "digits", "--clients", "20", "--partition", "dirichlet", "--alpha", "0.1",
              "--seed", "0", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "client" in res.output and "train" in res.output and "test" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["class_heatmap.png", "partition.json"]
    assert (out / "class_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    part = Partition.load(out / "partition.json", n_samples=1797)
    labels = load_dataset("digits").labels.numpy()
    expected = make_partition(labels, "dirichlet", 20, 0, alpha=0.1, dataset="digits")
    assert part.n_clients == 20
    for a, b in zip(part.clients, expected.clients):
        assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
    for row in range(20):  # the table lists every client with its split sizes
        c = part.clients[row]
        assert f"{len(c.train)}" in res.output


def test_file_partition_reuse_and_rerun(tmp_path):
    first = tmp_path / "a"
    assert run("--partition", "pathological", "--k", "2", "--clients", "6", "--public-fraction", "0.2",
               "--out", str(first)).exit_code == 0
    second = tmp_path / "b"
    res = run("--partition", f"file:{first / 'partition.json'}", "--out", str(second))
    assert res.exit_code == 0, res.output
    a = json.loads((first / "partition.json").read_text())
    b = json.loads((second / "partition.json").read_text())
    assert a["clients"] == b["clients"] and a["public"] == b["public"]
    # an option that would shape a split, with a saved one: a slip (--clients 3 was silently ignored)
    res = run("--partition", f"file:{first / 'partition.json'}", "--clients", "3", "--out", str(tmp_path / "c"))
    assert res.exit_code == 2 and "--clients: is only used to make a partition; --partition file:" in res.output
    assert not (tmp_path / "c").exists()
    assert run("--partition", "iid", "--clients", "4", "--out", str(first)).exit_code == 0  # replaces its own output
    assert len(json.loads((first / "partition.json").read_text())["clients"]) == 4


def test_cifar10_shared_subset_cli(tmp_path, shared_cifar10_tarball):
    res = run("--dataset", "cifar10", "--data-root", str(shared_cifar10_tarball), "--limit-per-class", "4",
              "--clients", "5", "--partition", "pathological", "--k", "2", "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    part = Partition.load(tmp_path / "c" / "partition.json", n_samples=80)
    assert part.meta["dataset"] == "cifar10" and part.n_clients == 5


def test_quiet_hides_the_bars_of_reading_a_source(tmp_path, shared_cifar10_tarball, monkeypatch):
    monkeypatch.setenv("RAFL_CACHE_DIR", str(tmp_path / "cache"))  # a cache miss: the tarball is read
    args = ("--dataset", "cifar10", "--data-root", str(shared_cifar10_tarball), "--limit-per-class", "3",
            "--clients", "3")
    loud = run(*args, "--out", str(tmp_path / "a"))
    assert loud.exit_code == 0 and "reading cifar10" in loud.stderr, loud.stderr[-500:]
    monkeypatch.setenv("RAFL_CACHE_DIR", str(tmp_path / "cache2"))
    quiet = run(*args, "--quiet", "--out", str(tmp_path / "b"))
    assert quiet.exit_code == 0 and "reading" not in quiet.stderr, quiet.stderr[-500:]


def test_femnist_natural_cli(tmp_path):
    from test_data_sources import _write_leaf

    _write_leaf(tmp_path / "leaf" / "train", {"f0000_14": 12, "f0001_41": 15, "f0002_07": 4}, seed=0)
    _write_leaf(tmp_path / "leaf" / "test", {"f0000_14": 2, "f0001_41": 3}, seed=1)
    res = run("--dataset", "femnist", "--data-root", str(tmp_path / "leaf"), "--partition", "natural",
              "--out", str(tmp_path / "f"))
    assert res.exit_code == 0, res.output
    part = Partition.load(tmp_path / "f" / "partition.json", n_samples=36)
    assert part.meta["writers"] == ["f0000_14", "f0001_41"]  # f0002_07 has < 10 samples
    assert [c.n_samples for c in part.clients] == [14, 18]


def _corrupt_cache_root(tmp_path):
    from test_data_sources import write_cifar10_batches  # tests/ is on sys.path (rootdir conftest)

    write_cifar10_batches(tmp_path / "cifar")
    load_dataset("cifar10", tmp_path / "cifar")
    (cache,) = cache_dir().glob("datasets/cifar10-*.npz")
    cache.write_bytes(cache.read_bytes()[:500])
    return ["--dataset", "cifar10", "--data-root", str(tmp_path / "cifar")]


BAD = [
    (["--dataset", "mnist"], "--dataset: is 'mnist', allowed: one of digits, cifar10, cifar100, femnist"),
    (["--partition", "pathological", "--k", "11"], "--k: is 11, allowed: an integer 1..10"),
    (["--partition", "pathological"], "--k: is required"),
    (["--partition", "dirichlet", "--k", "3"], "--k: is only used with --partition pathological"),
    (["--partition", "dirichlet", "--alpha", "0"], "--alpha: is 0.0, allowed: a finite number > 0"),
    (["--partition", "dirichlet", "--alpha", "-2"], "--alpha: is -2.0"),
    (["--clients", "5000", "--partition", "iid"], "--clients: is 5000, but only 1797 samples"),
    (["--clients", "0"], "--clients: is 0, allowed: an integer >= 1"),
    (["--clients", "-4"], "--clients: is -4"),
    (["--partition", "shards"], "--partition: is 'shards', allowed: one of iid, pathological, dirichlet, balanced-dirichlet, natural"),
    (["--partition", "natural"], "natural needs writer ids"),
    (["--public-fraction", "1.5"], "--public-fraction: is 1.5"),
    (["--split", "8:1"], "--split"),
    (["--dataset", "cifar10"], "--data-root: is required for cifar10 (or set $RAFL_DATA_ROOT"),
    (["--dataset", "cifar10", "--data-root", "/nonexistent/cifar"],
     "/nonexistent/cifar: --data-root: does not exist; expected cifar-10-batches-py/{data_batch_1..5"),
    (["--dataset", "femnist", "--data-root", "/nonexistent/femnist"], "expected LEAF json shards"),
    (["--partition", "file:/nonexistent/partition.json"], "partition file not found"),
    (["--clients", "100", "--alpha", "0.01", "--min-samples", "17"], "raise --alpha, lower --min-samples"),
    ("corrupt-cache", "corrupted cache file"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_exit_2_one_line_nothing_written(tmp_path, args, message):
    if args == "corrupt-cache":
        args = _corrupt_cache_root(tmp_path)
    out = tmp_path / "out"
    res = run(*args, "--out", str(out))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message in lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp dir left behind


def test_out_must_not_clobber_foreign_folder(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    res = run("--out", str(out))
    assert res.exit_code == 2 and "holds files that are not `rafl data` output (notes.txt)" in res.output
    assert (out / "notes.txt").read_text() == "keep me"
    # an earlier output beside a foreign file: refused too (the output replaces the whole folder)
    (out / "partition.json").write_text("{}")
    res = run("--out", str(out))
    assert res.exit_code == 2 and "not `rafl data` output (notes.txt)" in res.output
    assert (out / "notes.txt").read_text() == "keep me"
