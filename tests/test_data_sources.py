"""Dataset loaders on small files written in the real formats, the shared CIFAR-10 subset, the cache, loaders."""

from __future__ import annotations

import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rafl.data import load_dataset, make_loader, make_partition
from rafl.data.datasets import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD
from rafl.data.sources import cache_dir
from rafl.errors import UserInputError

PER_BATCH = 3  # images per class in each pickle batch


def _pixels(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)


def _denorm(x: torch.Tensor, mean, std) -> np.ndarray:
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return torch.round((x * s + m) * 255).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def write_cifar10_batches(folder: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The torchvision layout: cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta} (bytes keys)."""
    rng = np.random.default_rng(seed)
    d = folder / "cifar-10-batches-py"
    d.mkdir(parents=True)
    all_imgs, all_labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = np.tile(np.arange(10), PER_BATCH)
        imgs = _pixels(rng, len(labels))
        data = imgs.transpose(0, 3, 1, 2).reshape(len(labels), 3072)  # row = R(1024) G(1024) B(1024)
        batch = {b"batch_label": name.encode(), b"labels": labels.tolist(), b"data": data,
                 b"filenames": [f"{i}.png".encode() for i in range(len(labels))]}
        (d / name).write_bytes(pickle.dumps(batch, protocol=2))
        all_imgs.append(imgs)
        all_labels.append(labels)
    meta = {b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_cases_per_batch": 30, b"num_vis": 3072}
    (d / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return np.concatenate(all_imgs), np.concatenate(all_labels)


def write_image_folder(base: Path, classes: list[str], per_class: dict[str, int], ext: str = ".png",
                       seed: int = 0) -> dict[tuple[str, str], list[np.ndarray]]:
    """train/<class>/NNNN.<ext> and test/<class>/NNNN.<ext> with random 32x32 RGB pixels."""
    rng = np.random.default_rng(seed)
    written: dict[tuple[str, str], list[np.ndarray]] = {}
    for split, n in per_class.items():
        for c in classes:
            (base / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = _pixels(rng, 1)[0]
                Image.fromarray(arr).save(base / split / c / f"{i:04d}{ext}")
                written.setdefault((split, c), []).append(arr)
    return written


def _tar(src: Path, arcname: str, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tar:
        tar.add(src, arcname=arcname)
    return out


def test_digits_form():
    ds = load_dataset("digits")
    assert ds.images.shape == (1797, 3, 32, 32) and ds.images.dtype == torch.float32
    assert ds.labels.dtype == torch.int64 and ds.labels.shape == (1797,)
    assert ds.classes == [str(d) for d in range(10)] and ds.num_classes == 10
    assert ds.writers is None and set(ds.origin) == {"train"}
    assert torch.allclose(ds.images[:].mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert torch.allclose(ds.images[:].std(dim=(0, 2, 3)), torch.ones(3), atol=1e-3)
    assert torch.equal(ds.images[:, 0], ds.images[:, 2])  # grayscale repeated to 3 channels
    small = load_dataset("digits", resolution=24, limit_per_class=5)
    assert small.images.shape == (50, 3, 24, 24)
    assert np.bincount(small.labels.numpy()).tolist() == [5] * 10


def test_cifar10_pickle_batches_exact_pixels(tmp_path):
    imgs, labels = write_cifar10_batches(tmp_path)
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):  # parent or the folder itself
        ds = load_dataset("cifar10", root)
        assert ds.images.shape == (len(labels), 3, 32, 32) and ds.classes == CIFAR10_CLASSES
        assert np.array_equal(ds.labels.numpy(), labels)
        assert (ds.origin == "train").sum() == 5 * 10 * PER_BATCH and (ds.origin == "test").sum() == 10 * PER_BATCH
        assert np.array_equal(_denorm(ds.images[:], CIFAR10_MEAN, CIFAR10_STD), imgs)
    limited = load_dataset("cifar10", tmp_path, limit_per_class=2)
    assert len(limited) == 2 * 10 * 2  # 2 per class in train and in test
    for split in ("train", "test"):
        assert np.bincount(limited.labels.numpy()[limited.origin == split]).tolist() == [2] * 10


def test_cifar10_pickles_in_tarball(tmp_path):
    imgs, labels = write_cifar10_batches(tmp_path / "src")
    tgz = _tar(tmp_path / "src" / "cifar-10-batches-py", "cifar-10-batches-py", tmp_path / "cifar-10-python.tar.gz")
    ds = load_dataset("cifar10", tgz)
    assert np.array_equal(ds.labels.numpy(), labels)
    assert np.array_equal(_denorm(ds.images[:], CIFAR10_MEAN, CIFAR10_STD), imgs)


def test_cifar10_image_folder_png_exact_and_layouts(tmp_path):
    base = tmp_path / "cifar10"
    written = write_image_folder(base, CIFAR10_CLASSES, {"train": 3, "test": 2})
    for root in (base, tmp_path):  # the folder with train/test, or its parent holding cifar10/
        ds = load_dataset("cifar10", root)
        assert len(ds) == 50 and ds.classes == CIFAR10_CLASSES
        assert list(ds.origin[:30]) == ["train"] * 30 and list(ds.origin[30:]) == ["test"] * 20
        pix = _denorm(ds.images[:], CIFAR10_MEAN, CIFAR10_STD)
        assert np.array_equal(pix[0], written[("train", "airplane")][0])
        assert np.array_equal(pix[30 + 2 * 9 + 1], written[("test", "truck")][1])
        assert ds.labels.numpy()[:30].tolist() == np.repeat(np.arange(10), 3).tolist()


def test_cifar10_jpeg_folder_tarball_with_limit(tmp_path):
    write_image_folder(tmp_path / "src" / "cifar10", CIFAR10_CLASSES, {"train": 4, "test": 2}, ext=".jpg")
    tgz = _tar(tmp_path / "src" / "cifar10", "cifar10", tmp_path / "cifar10-jpeg.tar.gz")
    ds = load_dataset("cifar10", tgz, limit_per_class=3)
    assert len(ds) == 10 * 3 + 10 * 2
    assert np.bincount(ds.labels.numpy()[ds.origin == "train"]).tolist() == [3] * 10
    assert torch.isfinite(ds.images[:]).all()
    # a folder that holds the tarball under its usual name also works
    assert len(load_dataset("cifar10", tmp_path, limit_per_class=3)) == 50


def test_cifar100_standard_folder(tmp_path):
    rng = np.random.default_rng(0)
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    names = [f"class{i:03d}" for i in range(100)]
    expected = []
    for split, n in (("train", 200), ("test", 100)):
        fine = np.arange(n) % 100
        imgs = _pixels(rng, n)
        obj = {"filenames": [f"{i}.png" for i in range(n)], "batch_label": split, "fine_labels": fine.tolist(),
               "coarse_labels": (fine // 5).tolist(), "data": imgs.transpose(0, 3, 1, 2).reshape(n, 3072)}
        (d / split).write_bytes(pickle.dumps(obj, protocol=2))
        expected.append(fine)
    (d / "meta").write_bytes(pickle.dumps({"fine_label_names": names, "coarse_label_names": names[:20]}))
    ds = load_dataset("cifar100", tmp_path, resolution=28)
    assert ds.images.shape == (300, 3, 28, 28) and ds.num_classes == 100 and ds.classes[5] == "class005"
    assert np.array_equal(ds.labels.numpy(), np.concatenate(expected))
    part = make_partition(ds.labels.numpy(), "pathological", 10, seed=0, k=10)
    assert ((part.class_counts(ds.labels.numpy()) > 0).sum(axis=1) == 10).all()


def _write_leaf(folder: Path, users: dict[str, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    data = {"users": list(users), "num_samples": list(users.values()),
            "user_data": {u: {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}
                          for u, n in users.items()}}
    (folder / f"all_data_{seed}_niid_0_keep_0_train_9.json").write_text(json.dumps(data))


def test_femnist_leaf_json_and_natural_partition(tmp_path):
    root = tmp_path / "femnist" / "data"
    _write_leaf(root / "train", {"f0000_14": 12, "f0001_41": 15}, seed=0)
    _write_leaf(root / "train", {"f0002_07": 20}, seed=1)
    _write_leaf(root / "test", {"f0000_14": 3, "f0001_41": 4, "f0002_07": 5}, seed=2)
    ds = load_dataset("femnist", tmp_path / "femnist")
    assert ds.images.shape == (59, 1, 32, 32) and ds.num_classes == 62 and ds.classes[10] == "A"
    assert (ds.origin == "train").sum() == 47 and list(ds.origin[-12:]) == ["test"] * 12
    assert ds.writers is not None and sorted(set(ds.writers)) == ["f0000_14", "f0001_41", "f0002_07"]
    assert (ds.writers == "f0002_07").sum() == 25
    part = make_partition(ds.labels.numpy(), "natural", None, seed=0, writers=ds.writers, min_samples=10)
    assert [c.n_samples for c in part.clients] == [15, 19, 25]
    assert make_partition(ds.labels.numpy(), "natural", None, 0, writers=ds.writers, min_samples=16).n_clients == 2
    native = load_dataset("femnist", root, resolution=28)  # the data/ folder itself; 28x28 = native
    assert native.images.shape == (59, 1, 28, 28)
    cached = load_dataset("femnist", root, resolution=28)  # from the uint8 cache
    assert torch.equal(cached.images[:], native.images[:]) and np.array_equal(cached.writers, native.writers)
    assert len(list(cache_dir().glob("datasets/femnist-*.npz"))) == 2  # one per root
    first = json.loads(next((root / "train").glob("*_0_*.json")).read_text())["user_data"]["f0000_14"]["x"][0]
    pix = native.images[0, 0] * native.std[0] + native.mean[0]
    assert np.allclose(pix.numpy().ravel(), np.rint(np.array(first) * 255) / 255, atol=1e-5)
    limited = load_dataset("femnist", root, limit_per_class=1)
    assert all(np.bincount(limited.labels.numpy()[limited.origin == s]).max() == 1 for s in ("train", "test"))


def test_shared_cifar10_subset(shared_cifar10_tarball):
    ds = load_dataset("cifar10", shared_cifar10_tarball, limit_per_class=5)
    assert ds.images.shape == (100, 3, 32, 32) and ds.classes == CIFAR10_CLASSES
    assert np.bincount(ds.labels.numpy()[ds.origin == "train"]).tolist() == [5] * 10
    assert np.bincount(ds.labels.numpy()[ds.origin == "test"]).tolist() == [5] * 10
    assert abs(float(ds.images[:].mean())) < 0.5 and 0.6 < float(ds.images[:].std()) < 1.4  # real photos, CIFAR stats
    assert len(list(cache_dir().glob("datasets/cifar10-*.npz"))) == 1
    again = load_dataset("cifar10", shared_cifar10_tarball, limit_per_class=5)  # from the uint8 cache
    assert torch.equal(again.images[:], ds.images[:]) and torch.equal(again.labels, ds.labels)
    part = make_partition(ds.labels.numpy(), "pathological", 5, seed=0, k=2)
    assert ((part.class_counts(ds.labels.numpy()) > 0).sum(axis=1) == 2).all()


def test_cache_is_reused_and_keyed_by_source(tmp_path, monkeypatch):
    from rafl.data import sources

    write_cifar10_batches(tmp_path)
    first = load_dataset("cifar10", tmp_path)
    (cache,) = cache_dir().glob("datasets/cifar10-*.npz")
    with np.load(cache) as z:
        assert z["images"].dtype == np.uint8 and z["images"].shape == (180, 32, 32, 3)

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again although cached")

    monkeypatch.setattr(sources, "_decode_batches", no_decode)
    again = load_dataset("cifar10", tmp_path)  # served from the cache
    assert torch.equal(again.images[:], first.images[:])
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    os.utime(batch, ns=(batch.stat().st_atime_ns, batch.stat().st_mtime_ns + 10**9))  # source changed
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset("cifar10", tmp_path)
    assert len(list(cache_dir().glob("datasets/cifar10-*.npz"))) == 1


def test_corrupted_cache_via_load_dataset(tmp_path):
    write_cifar10_batches(tmp_path)
    load_dataset("cifar10", tmp_path)
    (cache,) = cache_dir().glob("datasets/cifar10-*.npz")
    cache.write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(UserInputError, match="corrupted cache file"):
        load_dataset("cifar10", tmp_path)


def test_malicious_pickle_is_refused(tmp_path):
    write_cifar10_batches(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(UserInputError, match="refusing to load"):
        load_dataset("cifar10", tmp_path)


@pytest.mark.parametrize("name,setup,match", [
    ("cifar10", None, r"does not exist; expected cifar-10-batches-py/\{data_batch_1..5"),
    ("cifar10", "empty", "holds no cifar10 data; expected"),
    ("cifar100", "empty", r"cifar-100-python/\{train, test, meta\}"),
    ("femnist", "empty", "holds no json shards; expected LEAF json shards"),
    ("cifar10", "file", "not a .tar.gz"),
    ("cifar10", "badtar", "cannot read the archive"),
    ("cifar10", "tenclasses", "found 3 classes"),
    ("femnist", "leaf-keys", "needs the LEAF keys users, num_samples, user_data"),
    ("femnist", "leaf-rows", "x must be 2 rows of 784 pixels"),
])
def test_missing_or_bad_roots(tmp_path, name, setup, match):
    root = tmp_path / "data"
    if setup == "empty":
        root.mkdir()
    elif setup == "file":
        root = tmp_path / "x.txt"
        root.write_text("hello")
    elif setup == "badtar":
        root = tmp_path / "broken.tar.gz"
        root.write_bytes(b"\x1f\x8b\x08\x00garbage")
    elif setup == "tenclasses":
        write_image_folder(root, ["a", "b", "c"], {"train": 1})
    elif setup == "leaf-keys":
        (root / "train").mkdir(parents=True)
        (root / "train" / "shard.json").write_text(json.dumps({"users": ["u"], "x": []}))
    elif setup == "leaf-rows":
        (root / "train").mkdir(parents=True)
        bad = {"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [[0.5] * 700] * 2, "y": [1, 2]}}}
        (root / "train" / "shard.json").write_text(json.dumps(bad))
    with pytest.raises(UserInputError, match=match) as err:
        load_dataset(name, root)
    assert "\n" not in str(err.value)


def test_default_data_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAFL_DATA_ROOT", str(tmp_path / "missing"))
    with pytest.raises(UserInputError, match=r"needs a data root \(--data-root, or \$RAFL_DATA_ROOT"):
        load_dataset("cifar10")
    write_image_folder(tmp_path / "cifar10", CIFAR10_CLASSES, {"test": 1})  # as `tar xzf` into the root unpacks
    monkeypatch.setenv("RAFL_DATA_ROOT", str(tmp_path))
    ds = load_dataset("cifar10")
    assert len(ds) == 10 and set(ds.origin) == {"test"}


def test_bad_dataset_arguments():
    with pytest.raises(UserInputError, match="allowed: one of digits, cifar10, cifar100, femnist"):
        load_dataset("mnist")
    with pytest.raises(UserInputError, match="resolution"):
        load_dataset("digits", resolution=0)
    with pytest.raises(UserInputError, match="limit_per_class"):
        load_dataset("digits", limit_per_class=0)


def test_make_loader_batches_and_determinism():
    ds = load_dataset("digits", limit_per_class=7)
    idx = np.arange(3, 53)
    loader = make_loader(ds, idx, batch_size=16, shuffle=False)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [16, 16, 16, 2]  # drop_last=False
    assert batches[0][0].shape == (16, 3, 32, 32) and batches[0][1].dtype == torch.int64
    assert torch.equal(torch.cat([b[1] for b in batches]), ds.labels[idx])
    assert len(loader) == 4 and len(loader.dataset) == 50
    shuffled = [torch.cat([y for _, y in make_loader(ds, idx, 8, True, seed=s)]) for s in (1, 1, 2)]
    assert torch.equal(shuffled[0], shuffled[1]) and not torch.equal(shuffled[0], shuffled[2])
    x_all = torch.cat([x for x, _ in make_loader(ds, idx, 8, True, seed=1)])
    assert torch.allclose(x_all.sum(0), ds.images[idx].sum(0), atol=1e-3)  # a permutation of the same samples
    assert len(list(make_loader(ds, np.zeros(0, dtype=np.int64), 4, True))) == 0
    with pytest.raises(UserInputError, match="batch_size"):
        make_loader(ds, idx, 0, False)
    with pytest.raises(UserInputError, match="out of range"):
        make_loader(ds, np.array([10_000]), 4, False)


def test_images_stay_uint8_and_batches_equal_whole_normalization(tmp_path):
    """CIFAR pixels stay uint8 in memory (1/4 of float32); every batch equals the whole-array
    normalization bit for bit, whatever the index form."""
    imgs, _ = write_cifar10_batches(tmp_path)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.images.pixels.dtype == torch.uint8 and ds.images.dtype == torch.float32
    assert ds.images.nbytes == imgs.size  # one byte per pixel and channel
    m = torch.tensor(CIFAR10_MEAN).view(1, -1, 1, 1)
    s = torch.tensor(CIFAR10_STD).view(1, -1, 1, 1)
    whole = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().mul_(1.0 / (255.0 * s)).add_(-m / s)
    assert torch.equal(ds.images[:], whole)
    idx = torch.tensor([5, 0, 17, 5])
    assert torch.equal(ds.images[idx], whole[idx])
    assert torch.equal(ds.images[3], whole[3]) and torch.equal(ds.images[2:9, 1], whole[2:9, 1])
    sub = ds.images.take(np.array([4, 8, 15]))
    assert sub.pixels.dtype == torch.uint8 and torch.equal(sub[:], whole[[4, 8, 15]])
    loader = make_loader(ds, np.arange(20), batch_size=8, shuffle=False)
    assert torch.equal(torch.cat([x for x, _ in loader]), whole[:20])
    resized = load_dataset("cifar10", tmp_path, resolution=16)  # resized once, kept as uint8
    assert resized.images.pixels.dtype == torch.uint8 and resized.images.shape[-1] == 16


def test_digits_keep_float_pixels_and_normalize_per_batch():
    ds = load_dataset("digits", resolution=16)
    assert ds.images.pixels.dtype == torch.float32  # resized 8x8 originals are not integers
    whole = ds.images[:]
    assert torch.equal(ds.images[torch.arange(10, 20)], whole[10:20])


def test_public_pool_comes_from_the_train_split_only(tmp_path):
    from rafl.data import carve_public_pool
    from rafl.supernet.server_data import server_split

    write_cifar10_batches(tmp_path)
    ds = load_dataset("cifar10", tmp_path)
    labels = ds.labels.numpy()
    pool = carve_public_pool(labels, 0.5, 0, ds.origin)
    assert set(ds.origin[pool]) == {"train"}
    n_train_per_class = np.bincount(labels[ds.origin == "train"])
    assert np.bincount(labels[pool]).tolist() == [int(round(0.5 * n)) for n in n_train_per_class]
    split = server_split(ds, public_fraction=0.5, test_samples=None)
    assert np.array_equal(np.sort(np.concatenate([split.pool_train, split.pool_val])), pool)
    assert np.array_equal(split.test, np.flatnonzero(ds.origin == "test"))  # the whole test split, untouched
    part = make_partition(labels, "iid", 3, seed=0, public_fraction=0.5, origin=ds.origin)
    assert np.array_equal(part.public, pool)
