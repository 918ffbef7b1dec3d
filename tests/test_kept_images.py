"""Issue 60: a run keeps in memory only the images its partition, global test set and (when the
method reads it) public pool use; the batches, and so every number of a run, are the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rafl.config import RunConfig
from rafl.data.datasets import Images
from rafl.federation.build import used_samples
from rafl.stages.prepare import prepare
from rafl.stages.runs import run_engine


def _images(n: int = 12) -> Images:
    pixels = torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return Images(pixels, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))


def test_views_and_kept_images_index_like_the_whole_set():
    full = _images()
    idx = torch.tensor([7, 1, 9, 1])
    view = full.view(torch.tensor([1, 7, 9, 11]))
    assert len(view) == 4 and tuple(view.shape) == (4, 3, 4, 4)
    assert torch.equal(view[torch.tensor([1, 0])], full[torch.tensor([7, 1])])
    assert torch.equal(view[1:3], full[torch.tensor([7, 9])])
    kept = full.keep_only([9, 7, 1])
    assert len(kept) == len(full) and kept.pixels.shape[0] == 3
    assert torch.equal(kept[idx], full[idx])
    assert torch.equal(kept[7], full[7])
    assert torch.equal(kept.view([9, 1])[0:2], full[torch.tensor([9, 1])])  # a view of kept images
    with pytest.raises(IndexError, match="not kept"):
        kept[torch.tensor([1, 2])]


def _config(method: str, train: dict | None = None, **hp) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 0, "data": {"dataset": "digits", "limit_per_class": 30},
        "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_samples": 10, "public_fraction": 0.3,
                      "global_test_per_class": 3},
        "clients": {"n": 4, "models": "cnn4-small", "feature_dim": 16},
        "algorithm": {"name": method, "local_epochs": 1, **hp},
        "engine": {"rounds": 2, "clients_per_round": 2, "workers": 1},
        "train": {"batch_size": 8, "threads": 1, **(train or {})},
    })


@pytest.mark.parametrize("method,hp,train,reads_pool", [("fedproto", {}, {}, False),
                                                        ("feddf", {"distill_epochs": 1}, {}, True),
                                                        ("fedavg", {}, {"bn_statistics": "server"}, True)])
def test_a_run_on_the_kept_images_equals_one_on_all(tmp_path, method, hp, train, reads_pool):
    """The same metrics (bit for bit) with only the used images in memory as with all of them; the
    pool stays only for a method that reads it: FedDF distils on it, ``train.bn_statistics: server``
    re-estimates every deployed model's BN statistics on it."""
    cfg = _config(method, train, **hp)
    summaries = {}
    for keep_all in (True, False):
        prep = prepare(cfg, progress=False, keep_all_images=keep_all)
        ds, part = prep.dataset, prep.partition
        kept = ds.images.pixels.shape[0]
        if keep_all:
            assert kept == len(ds)
        else:
            assert kept == len(used_samples(part, prep.federation.algorithm))
            # digits is all clients, pool and global test: the pool is what a method without it drops
            assert kept == len(ds) - (0 if reads_pool else len(part.public))
        pool = prep.federation.server.public_images
        assert (pool is not None) is reads_pool
        if reads_pool:
            assert torch.equal(pool[torch.arange(len(pool))], ds.images[torch.as_tensor(np.asarray(part.public))])
        run_dir = tmp_path / f"{method}-{keep_all}"
        run_dir.mkdir()
        summaries[keep_all] = run_engine(prep.federation, prep.engine_config, run_dir, progress=False)
    for key in ("final", "cum_bytes_up", "cum_bytes_down", "clients"):
        assert summaries[False][key] == summaries[True][key], key
