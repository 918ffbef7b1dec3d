"""The default supernet of the quickstart pipeline: trained once on the digits public pool, cached."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

from rafl.data import carve_public_pool, load_dataset
from rafl.errors import UserInputError
from rafl.io import atomic_dir
from rafl.supernet.checkpoint import META_NAME, load_supernet
from rafl.supernet.model import Supernet
from rafl.supernet.train import TrainConfig, train_supernet
from rafl.threads import torch_threads


def cache_root() -> Path:
    """``$RAFL_CACHE_DIR`` if set, else ``~/.cache/rafl``."""
    env = os.environ.get("RAFL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rafl"


def quickstart_config() -> TrainConfig:
    """The quickstart's training config: :class:`TrainConfig` defaults (digits, public pool 0.3, seed 0)."""
    return TrainConfig()


#: torch threads the quickstart supernet trains with. Float sums differ with the thread count, so
#: a supernet trained with 2 threads is another supernet (measured: another test accuracy, another
#: search result) than one trained with 1; a fixed count makes the default pipeline's numbers the
#: same on every machine with this torch build (and equal to bench/results/supernet_accuracy_digits.txt).
QUICKSTART_THREADS = 1


def quickstart_dir(config: TrainConfig | None = None) -> Path:
    """Cache folder ``<cache_root>/quickstart-supernet-<hash>``; the hash covers the config, the
    pool and :data:`QUICKSTART_THREADS` (a cache trained before the count was fixed is retrained)."""
    config = config or quickstart_config()
    labels = load_dataset(config.dataset, config.data_root, resolution=8).labels.numpy()
    pool = carve_public_pool(labels, config.public_fraction, config.public_seed)
    key = config.model_dump_json().encode() + pool.tobytes() + f"threads={QUICKSTART_THREADS}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_root() / f"quickstart-supernet-{digest}"


def quickstart_supernet(progress: bool = True) -> tuple[Supernet, Path]:
    """The default supernet (digits), trained once and cached; later calls load it (seconds).

    Trains with :func:`quickstart_config` on the digits server public pool
    (``carve_public_pool(labels, 0.3, seed=0)``, 90% pool-train) and caches the result under
    :func:`quickstart_dir`. When it has to train, it says so (stderr) with the cache path. The
    cache is written atomically: an interrupted training leaves no partial cache.

    Returns:
        ``(supernet in eval mode on CPU, cache folder)``.
    """
    config = quickstart_config()
    folder = quickstart_dir(config)
    if (folder / META_NAME).is_file():
        return load_supernet(folder), folder
    # One trainer at a time: concurrent callers (parallel tests, two terminals) wait for the
    # first one's cache instead of each training and overwriting it.
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / META_NAME).is_file():
            _train_into(config, folder, progress)
    return load_supernet(folder), folder


def quickstart_space():
    """The quickstart supernet's :class:`~rafl.supernet.arch.SearchSpace` (width x0.35, 12/14/16 px,
    10 classes), from its config alone: nothing is trained or loaded. What ``rafl search`` and
    ``rafl federate`` search in without ``--supernet``, and so what ``rafl profile --build-lut``
    measures by default."""
    return quickstart_config().space(n_classes=10)  # digits: 10 classes


#: the name that stands for the cached quickstart supernet where a supernet folder is expected
#: (``rafl supernet info quickstart``, ``rafl profile --supernet quickstart``)
QUICKSTART_NAME = "quickstart"


def quickstart_folder(field: str | None = None) -> Path:
    """The cached quickstart supernet's folder (``<cache_root>/quickstart-supernet-<hash>``).

    Raises:
        UserInputError: it has not been trained yet on this machine (naming ``field``, the folder
            it will have, and the commands that train it).
    """
    folder = quickstart_dir()
    if not (folder / META_NAME).is_file():
        raise UserInputError(f"the quickstart supernet is not trained yet (it will be cached in {folder}); "
                             "`rafl search --device-profile pi4` or `rafl federate` trains it on first use "
                             "(about 4 min with one thread), or give a `rafl supernet train` folder",
                             field=field)
    return folder


def supernet_path(text: str | Path, field: str | None = None) -> Path:
    """``text`` as a supernet folder: :data:`QUICKSTART_NAME` is the cached quickstart supernet's
    (:func:`quickstart_folder`) unless a folder of that name exists here; anything else, the path."""
    if str(text) == QUICKSTART_NAME and not Path(text).exists():
        return quickstart_folder(field)
    return Path(text)


def _train_into(config: TrainConfig, folder: Path, progress: bool) -> None:
    print(f"rafl: training the quickstart supernet once on the digits public pool (a few minutes on "
          f"2 CPU cores); caching it in {folder}", file=sys.stderr, flush=True)
    with atomic_dir(folder, overwrite=True) as tmp, torch_threads(QUICKSTART_THREADS):
        _, metrics = train_supernet(config, tmp, progress=progress)
    print("rafl: quickstart supernet test accuracy (held-out digits): "
          + json.dumps({k: round(v, 4) for k, v in metrics["test"].items()}), file=sys.stderr, flush=True)


__all__ = ["QUICKSTART_NAME", "QUICKSTART_THREADS", "cache_root", "quickstart_config", "quickstart_dir", "quickstart_folder",
           "quickstart_space", "quickstart_supernet", "supernet_path"]
