"""The checks answered before torch loads (rafl.stages.checks, rafl.federation.catalog, the run
config's cross-field checks, the data root's layout): each says what the later work would have
said, naming the field. That the commands answer them without torch: tests/test_newcomer.py."""

from __future__ import annotations

import pytest

from rafl.config import read_run_config
from rafl.data.sources import check_data_root
from rafl.errors import UserInputError
from rafl.federation.catalog import DEFAULT_ALGORITHMS, check_hyperparameter_names, check_method, method_catalog
from rafl.stages.checks import check_resume_dir, precheck_run

from conftest import SHARED_CIFAR10


def test_the_catalogue_read_from_the_source_is_the_registry():
    """Every registered method and its hyperparameter names, in declaration order, as importing
    the algorithms gives them: a new method needs no second list."""
    from rafl.federation.algorithms import ALGORITHMS

    assert method_catalog() == {name: tuple(cls.defaults) for name, cls in sorted(ALGORITHMS.items())}
    assert check_method("FedGH") == "fedgh"
    with pytest.raises(UserInputError, match=r"unknown algorithm 'fedx'; one of centralized, fd, fedavg, .*uniform") as err:
        check_method("fedx")
    assert err.value.field == "algorithm.name"
    with pytest.raises(UserInputError, match=r"unknown hyperparameter\(s\) \['tauu'\] for 'fedtgp'; allowed: \[.*'tau'"):
        check_hyperparameter_names("fedtgp", {"tauu": 1, "lambda": 0.5})


def test_rafl_compare_takes_its_default_methods_and_its_help_from_the_catalogue():
    """``--algorithms``' default is :data:`DEFAULT_ALGORITHMS` (registered methods, each once), and
    its help names every registered method."""
    from click.testing import CliRunner

    from rafl.cli import cli

    assert set(DEFAULT_ALGORITHMS) <= set(method_catalog()) and len(set(DEFAULT_ALGORITHMS)) == len(DEFAULT_ALGORITHMS)
    res = CliRunner().invoke(cli, ["compare", "--help"], terminal_width=1000)
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("--algorithms"))
    assert f"Comma-separated registered methods: {', '.join(method_catalog())}." in line
    assert f"[default: {','.join(DEFAULT_ALGORITHMS)}]" in line


@pytest.mark.parametrize(("sets", "field", "text"), [
    (["engine.clients_per_round=20"], "engine.clients_per_round", "is 20, more than the 10 clients (clients.n)"),
    (["engine.available=4", "engine.clients_per_round=5"], "engine.clients_per_round",
     "is 5, more than the 4 available clients"),
    (["clients.n=3", "engine.available=4"], "engine.available", "is 4, more than the 3 clients (clients.n)"),
    (["engine.clients_per_round=0.2", "engine.min_valid_uploads=3"], "engine.min_valid_uploads",
     "is 3, more than the 2 client(s) sampled per round"),
    (["engine.backend=flower", "engine.supernodes=11"], "engine.supernodes", "is 11 but the run has 10 clients"),
    (["partition.scheme=pathological"], "partition.k", "is required for partition.scheme pathological"),
    (["partition.alpha=null"], "partition.alpha", "is required for partition.scheme dirichlet"),
])
def test_fields_that_contradict_each_other_are_refused_when_the_config_is_read(sets, field, text):
    with pytest.raises(UserInputError) as err:
        read_run_config(None, sets)
    assert err.value.field == field and text in err.value.message, err.value
    assert err.value.source == ("--set" if field in {s.split("=")[0] for s in sets} else None)


def test_settings_that_fit_together_pass():
    cfg, _ = read_run_config(None, ["engine.supernodes=11", "engine.clients_per_round=10",
                                    "engine.min_valid_uploads=10", "partition.scheme=pathological", "partition.k=2"])
    assert cfg.engine.supernodes == 11  # in-process: ignored, as its description says


@pytest.mark.parametrize(("sets", "field", "text"), [
    (["data.dataset=cifar10", "supernet.path=cifar10", "data.root=/nonexistent/c10"], "data.root", "does not exist"),
    # a data root that exists (CI's HOME is empty: the default ~/.cache/rafl-data is not there)
    (["data.dataset=cifar10", f"data.root={SHARED_CIFAR10}"], "supernet.path", "the quickstart supernet is for digits"),
    (["clients.budgets={pi9: {macs_m: 3}}"], "clients.budgets", "names profile(s) ['pi9'] that no client uses"),
    (["partition.public_fraction=0"], "partition.public_fraction", "need the server's public pool"),
])
def test_a_run_is_checked_before_data_and_models_load(sets, field, text):
    with pytest.raises(UserInputError) as err:
        precheck_run(None, sets)
    assert err.value.field == field and text in err.value.message, err.value
    precheck_run(None, sets[-1:] if field == "data.root" else [], data=False)  # --show-config: no data needed


def test_a_resume_folder_is_checked_by_its_files(tmp_path):
    with pytest.raises(UserInputError, match="does not exist"):
        check_resume_dir(tmp_path / "none")
    with pytest.raises(UserInputError, match=r"is not a rafl federate run dir \(no config.yaml\)"):
        check_resume_dir(tmp_path)
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserInputError, match="never completed a round"):
        check_resume_dir(tmp_path)
    (tmp_path / "checkpoint.safetensors").write_bytes(b"")
    assert check_resume_dir(tmp_path) == tmp_path
    (tmp_path / "config.yaml").write_text("algorithms: {rafl: {}}\n")
    with pytest.raises(UserInputError, match="is a rafl compare folder"):
        check_resume_dir(tmp_path)


def test_a_data_root_is_checked_for_the_datasets_layout_by_file_names(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserInputError, match=r"is a file but not a .tar.gz/.tgz/.tar archive"):
        check_data_root("cifar10", tmp_path / "notes.txt")
    with pytest.raises(UserInputError, match="holds no cifar100 data"):
        check_data_root("cifar100", tmp_path)
    with pytest.raises(UserInputError, match="holds no json shards"):
        check_data_root("femnist", tmp_path)
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "batches.meta").write_bytes(b"")  # the names only: no file is read
    assert check_data_root("cifar10", tmp_path) == tmp_path


@pytest.mark.parametrize(("torch_v", "vision_v", "command"), [
    ("2.14.1", "0.28.0", "pip install torch==2.14.1 torchvision==0.29.1"),
    ("2.13.0+cpu", "0.28.0", "pip install torch==2.13.0 torchvision==0.28.0 --index-url "
                             "https://download.pytorch.org/whl/cpu"),
])
def test_a_torchvision_built_for_another_torch_is_one_line_and_the_pip_command(monkeypatch, torch_v, vision_v,
                                                                             command):
    """What `import torchvision` raises on a torch it was not built for (simulated: the import is
    patched, the installed pair is not touched): one line with both versions and the fix, exit 2."""
    import builtins

    from click.testing import CliRunner

    import rafl.cli
    import rafl.cli.data

    real_import = builtins.__import__

    def broken_torchvision(name, *args, **kwargs):
        if name.split(".")[0] == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    def command_that_loads_torchvision(**kwargs):
        import torchvision  # noqa: F401

    monkeypatch.setattr(builtins, "__import__", broken_torchvision)
    monkeypatch.setattr(rafl.cli, "installed_version", {"torch": torch_v, "torchvision": vision_v}.__getitem__)
    monkeypatch.setattr(rafl.cli.data.data, "callback", command_that_loads_torchvision)
    res = CliRunner().invoke(rafl.cli.cli, ["data"])
    assert res.exit_code == 2
    assert res.output == (f"error: torchvision {vision_v} was not built for the installed torch {torch_v} (operator "
                          f"torchvision::nms does not exist); install the matching pair: {command}\n")
    assert rafl.cli.torch_pair_error(RuntimeError("another failure")) is None
