"""Shared fixtures: fixed seeds, small thread counts, temporary cache dirs, shared CIFAR-10 path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: the real CIFAR-10 JPEG tarball: ``$RAFL_TEST_CIFAR10``, else ``../shared/data`` beside the repo
SHARED_CIFAR10 = Path(os.environ.get("RAFL_TEST_CIFAR10") or REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own rafl cache dir (never the user's; fixtures of a wider scope use the
    session's, set in :func:`pytest_configure`)."""
    monkeypatch.setenv("RAFL_CACHE_DIR", str(tmp_path_factory.mktemp("rafl-cache")))


@pytest.fixture(scope="session")
def shared_cifar10_tarball() -> Path:
    """The real CIFAR-10 JPEG tarball from ../shared/data (present on dev machines and in CI)."""
    if not SHARED_CIFAR10.is_file():
        raise FileNotFoundError(f"shared CIFAR-10 not found at {SHARED_CIFAR10}; the tests that read real "
                                f"CIFAR-10 need it: set RAFL_TEST_CIFAR10 to the cifar10-jpeg.tar.gz path")
    return SHARED_CIFAR10


@pytest.fixture(scope="module")
def tiny():
    """``(space, supernet, dataset, partition)``: a width-0.25, 16 px untrained supernet (seed 0) and
    10 digits per class over 3 Dirichlet(1.0) clients with a 20% public pool (a file that needs
    another setup defines its own ``tiny``)."""
    import torch

    from rafl.data import load_dataset, make_partition
    from rafl.supernet import SearchSpace, build_supernet

    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    supernet = build_supernet(space).eval()
    ds = load_dataset("digits", limit_per_class=10)
    part = make_partition(ds.labels.numpy(), "dirichlet", 3, 0, alpha=1.0, min_samples=5, public_fraction=0.2)
    return space, supernet, ds, part


@pytest.fixture(scope="module")
def tiny_supernet(tmp_path_factory):
    """``(folder, space)``: a width-0.25, 16 px supernet saved like `rafl supernet train` does,
    recording its public pool (fraction 0.3, seed 0)."""
    import torch

    from rafl.supernet import SearchSpace, build_supernet, save_supernet

    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    d = tmp_path_factory.mktemp("supernet")
    save_supernet(d, build_supernet(space).eval(), config={"public_fraction": 0.3, "public_seed": 0}, metrics={})
    return d, space


def pytest_configure(config):
    import tempfile

    import torch

    # One intra-op thread: tests use tiny models, for which a second thread costs more in
    # synchronisation than it gains (measured 8-15x slower on a loaded 2-core machine).
    torch.set_num_threads(1)
    # module- and session-scoped fixtures run before the per-test cache dir (_isolated_cache) is
    # set: they get this session's own (one per xdist worker), never the user's ~/.cache/rafl
    config._rafl_cache = tempfile.TemporaryDirectory(prefix="rafl-test-cache-")
    os.environ["RAFL_CACHE_DIR"] = config._rafl_cache.name


def pytest_unconfigure(config):
    cache = getattr(config, "_rafl_cache", None)
    if cache is not None:
        cache.cleanup()


def pytest_collection_modifyitems(config, items):
    """Mark ``integration`` (see pyproject's markers) every test that reads the shared CIFAR-10
    tarball; tests that start other processes or services (Ray, a SuperLink with SuperNodes, a rafl
    subprocess) mark themselves. ``-m "not slow and not integration"`` is the quick subset
    (docs/development.md, "Tests")."""
    for item in items:
        if "shared_cifar10_tarball" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
