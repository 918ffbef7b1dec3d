"""A payload is immutable once counted; the engine writes no report itself (its observers do)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from rafl.federation.algorithms.fedavg import FedAvg
from rafl.federation.build import build_federation
from rafl.federation.engine import CHECKPOINT, Engine, EngineConfig
from rafl.federation.payload import CountedPayload, Payload
from rafl.federation.screening import UploadPolicy, screen_uploads
from rafl.reports.run import RunReport


def test_count_freezes_the_payload_and_keeps_its_bytes():
    p = Payload({"w": torch.arange(6.0).reshape(2, 3)}, {"n_samples": 5, "class_ids": [0, 3]})
    c = p.count()
    assert isinstance(c, CountedPayload) and isinstance(c, Payload) and c.count() is c
    assert c.nbytes() == p.nbytes() and c.to_bytes() == p.to_bytes()
    with pytest.raises(TypeError):
        c.meta["client_id"] = 1
    with pytest.raises(TypeError):
        c.tensors["junk"] = torch.zeros(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.meta = {}
    back = pickle.loads(pickle.dumps(c))
    assert isinstance(back, CountedPayload) and back.to_bytes() == c.to_bytes() and back.nbytes() == c.nbytes()
    view = c.with_meta(client_id=7)
    assert type(view) is Payload and view.meta == {"n_samples": 5, "class_ids": [0, 3], "client_id": 7}
    assert view.tensors["w"].data_ptr() == c.tensors["w"].data_ptr()  # shared, not copied
    assert dict(c.meta) == {"n_samples": 5, "class_ids": (0, 3)}  # the counted one is unchanged


def test_screening_leaves_the_counted_upload_alone():
    up = Payload({"w": torch.ones(2)}, {"n_samples": 10**12})
    state = {"global": {"w": torch.zeros(2)}}
    out = screen_uploads([(4, up)], FedAvg(), state, {4: _Info(4, 30)}, 3, UploadPolicy(), limits={4: 1 << 20},
                         sender=lambda c: f"client {c}")
    assert up.meta == {"n_samples": 10**12}  # what the client sent
    assert out.accepted[0].meta == {"n_samples": 30, "client_id": 4} and out.accepted_ids == [4]
    assert out.bytes_up == up.nbytes() and out.claims_overridden == [4]


@dataclasses.dataclass
class _Info:
    client_id: int
    n_samples: int


class _Recorder:
    """An observer that records what it was told and whether the round's checkpoint existed yet."""

    def __init__(self, run_dir):
        self.run_dir, self.rounds, self.done = run_dir, [], None

    def round_done(self, history):
        self.rounds.append((len(history), (self.run_dir / CHECKPOINT).is_file()))

    def run_done(self, history, summary):
        self.done = (len(history), summary["rounds"])


class _ChecksItsDownload(FedAvg):
    def client_update(self, state, broadcast, client):
        assert isinstance(broadcast, CountedPayload)
        return super().client_update(state, broadcast, client)


def test_the_engine_writes_no_report_and_tells_its_observers_before_each_checkpoint(tmp_path):
    from rafl.data import load_dataset, make_partition
    from rafl.supernet import SearchSpace, build_supernet

    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    supernet = build_supernet(space).eval()
    ds = load_dataset("digits", limit_per_class=10)
    part = make_partition(ds.labels.numpy(), "dirichlet", 3, 0, alpha=1.0, min_samples=5, public_fraction=0.2)
    fed, _ = build_federation(ds, part, supernet, [space.smallest()] * 3, _ChecksItsDownload(local_epochs=1),
                              batch_size=16, count_macs=False)
    seen = _Recorder(tmp_path / "bare")
    (tmp_path / "bare").mkdir()
    Engine(fed, EngineConfig(rounds=2, workers=1), tmp_path / "bare", progress=False, observers=[seen]).run()
    assert seen.rounds == [(1, False), (2, True)] and seen.done == (2, 2)
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == [CHECKPOINT, "clients"]
    (tmp_path / "report").mkdir()
    Engine(fed, EngineConfig(rounds=1, workers=1), tmp_path / "report", progress=False,
           observers=[RunReport(tmp_path / "report")]).run()
    assert {"metrics.jsonl", "metrics.csv", "summary.json", "accuracy_vs_round.png", "accuracy_vs_mb.png"} <= {
        p.name for p in (tmp_path / "report").iterdir()}
