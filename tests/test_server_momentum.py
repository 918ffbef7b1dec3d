"""FedAvg's server momentum (FedAvgM; Hsu et al. 2019, Sec. 3; Reddi et al., ICLR 2021, Alg. 1):
``v^t = beta v^{t-1} + Delta^t``, ``w^{t+1} = w^t + eta_s v^t`` on the parameters, buffers averaged;
the defaults are FedAvg bit for bit; the velocity survives a resume."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rafl.config import RunConfig
from rafl.errors import UserInputError
from rafl.federation.algorithms import get_algorithm
from rafl.federation.store import load_state
from rafl.stages.prepare import prepare
from rafl.stages.runs import run_engine


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


def _state(fill: float) -> dict[str, torch.Tensor]:
    net = _net()
    return {k: torch.full_like(v, fill) if v.is_floating_point() else v.clone() for k, v in net.state_dict().items()}


def test_the_step_follows_fedavgm_on_parameters_and_averages_buffers():
    server = SimpleNamespace(make_model=lambda client_id: _net())
    algo = get_algorithm("uniform")(server_lr=0.5, server_momentum=0.9)
    w0, avg1, avg2 = _state(1.0), _state(3.0), _state(2.0)
    s1 = algo._server_step({"global": w0}, avg1, server, 0)
    # round 1: v = Delta = 2, w = 1 + 0.5 * 2 = 2 on parameters; buffers (BN statistics) the average
    assert torch.equal(s1["global"]["0.weight"], torch.full((2, 3), 2.0))
    assert torch.equal(s1["velocity"]["1.bias"], torch.full((2,), 2.0))
    assert torch.equal(s1["global"]["1.running_mean"], avg1["1.running_mean"])
    assert set(s1["velocity"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    s2 = algo._server_step(s1, avg2, server, 0)
    # round 2: Delta = 2 - 2 = 0, v = 0.9 * 2 + 0 = 1.8, w = 2 + 0.5 * 1.8 = 2.9
    assert torch.allclose(s2["global"]["0.bias"], torch.full((2,), 2.9))
    assert torch.allclose(s2["velocity"]["0.bias"], torch.full((2,), 1.8))


def test_the_defaults_are_fedavg_and_a_server_lr_alone_keeps_no_velocity():
    server = SimpleNamespace(make_model=lambda client_id: _net())
    avg = _state(3.0)
    plain = get_algorithm("fedavg")()._server_step({"global": _state(1.0)}, avg, server, 0)
    assert plain == {"global": avg}
    scaled = get_algorithm("fedavg")(server_lr=2.0)._server_step({"global": _state(1.0)}, avg, server, 0)
    assert set(scaled) == {"global"} and torch.equal(scaled["global"]["0.weight"], torch.full((2, 3), 5.0))


def test_bad_values_name_the_field_and_fednova_has_its_own_step():
    with pytest.raises(UserInputError, match=r"server_momentum.*\[0, 1\)"):
        get_algorithm("fedavg")(server_momentum=1.0)
    with pytest.raises(UserInputError, match="server_lr"):
        get_algorithm("uniform")(server_lr=0)
    with pytest.raises(UserInputError, match=r"unknown hyperparameter.*'server_momentum'"):
        get_algorithm("fednova")(server_momentum=0.5)
    assert get_algorithm("fedprox")(server_momentum=0.5).hparams["server_momentum"] == 0.5


def _config(rounds: int) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 0, "data": {"dataset": "digits", "limit_per_class": 20},
        "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_samples": 10, "public_fraction": 0.3},
        "clients": {"n": 3, "models": "cnn4-small", "feature_dim": 16},
        "algorithm": {"name": "fedavg", "local_epochs": 1, "server_momentum": 0.9, "server_lr": 0.5},
        "engine": {"rounds": rounds, "clients_per_round": 1.0, "workers": 1},
        "train": {"batch_size": 8, "threads": 1},
    })


def test_the_velocity_is_checkpointed_and_a_resumed_run_equals_a_straight_one(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    prep = prepare(_config(2), progress=False)
    run_engine(prep.federation, prep.engine_config, straight, progress=False)
    prep1 = prepare(_config(1), progress=False)
    run_engine(prep1.federation, prep1.engine_config, resumed, progress=False)
    assert "velocity" in load_state(resumed / "checkpoint.safetensors")["server_state"]
    prep2 = prepare(_config(2), progress=False)
    run_engine(prep2.federation, prep2.engine_config, resumed, resume=True, progress=False)
    a = load_state(straight / "checkpoint.safetensors")["server_state"]
    b = load_state(resumed / "checkpoint.safetensors")["server_state"]
    assert set(a) == {"global", "velocity"}
    for part in ("global", "velocity"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part])
