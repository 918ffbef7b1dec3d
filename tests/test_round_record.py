"""A round's typed record (rafl.federation.round_record): its row is the line of metrics.jsonl the
engine writes, key order included, and a row reads back into the same record (--resume).

The rows below are lines of metrics.jsonl as the engine wrote them before the record was typed
(tiny digits runs), reasons shortened; ``FULL`` puts the optional parts of several such lines into
one (a runner that loses clients and reports its traffic, a refused upload, an overridden
``n_samples``, a failed round, an extra evaluation key, the shared evaluation of untrained clients).
"""

from __future__ import annotations

import json

import pytest

from rafl.federation.metric_keys import round_figure
from rafl.federation.round_record import (
    COUNTERS,
    TIMES,
    ModelAccuracy,
    RoundEvaluation,
    RoundRecord,
)

#: every optional part of a row, in the order the engine writes them
FULL = ('{"round": 2, "sampled": 3, "failed": 1, "participated": 2, "bytes_up": 1331216, "bytes_down": 1996776, '
        '"cum_bytes_up": 2662432, "cum_bytes_down": 3993552, "cum_mb": 6.655984, "bytes_up_per_client": 1331216.0, '
        '"rejected": 1, "rejected_reasons": {"1": "payload from client 1: payload.meta.extra: not allowed"}, '
        '"bytes_rejected": 651299, "n_samples_overridden": [0], "round_failed": true, '
        '"lost": {"2": "node 7 timed out"}, '
        '"model.acc_mean_over_clients": 0.25, "model.acc_sample_weighted": 0.25, "model.acc_std_over_clients": 0.25, '
        '"model@global.acc_mean_over_clients": 0.1, "model@global.acc_sample_weighted": 0.1, '
        '"model@global.acc_std_over_clients": 0.0, "model.loss.mean": 0.25, '
        '"eval.trained_clients": 1, "eval.untrained_clients": 1, '
        '"model.acc_untrained_sample_weighted": 0.0, "model.acc_all_sample_weighted": 0.16666666666666666, '
        '"model@global.acc_untrained_sample_weighted": 0.1, "model@global.acc_all_sample_weighted": 0.1, '
        '"eval_lost": {"0": "node 3 failed"}, '
        '"wire_bytes_down": 1000, "wire_bytes_up": 2000, "wire_bytes_eval_down": 300, "cum_wire_mb": 0.006, '
        '"time_s": 0.2642086619962356, "time_client_update_s": 0.08967104299881612, '
        '"time_aggregate_s": 0.03507654200075194, "time_evaluate_s": 0.08363939599803416, '
        '"time_engine_s": 0.05582168099863338}')
#: a round that was not evaluated
PLAIN = ('{"round": 1, "sampled": 3, "failed": 2, "participated": 1, "bytes_up": 392, "bytes_down": 0, '
         '"cum_bytes_up": 392, "cum_bytes_down": 0, "cum_mb": 0.000392, "bytes_up_per_client": 392.0, "rejected": 0, '
         '"time_s": 0.09789716400337056, "time_client_update_s": 0.09023493000131566, '
         '"time_aggregate_s": 0.0012717210011032876, "time_evaluate_s": 0.0, "time_engine_s": 0.006390513000951614}')
#: two models evaluated (RaFL's knowledge network sorts before the deployed model)
TWO_MODELS = ('{"round": 3, "sampled": 3, "failed": 0, "participated": 3, "bytes_up": 595716, "bytes_down": 595668, '
              '"cum_bytes_up": 1787148, "cum_bytes_down": 1787004, "cum_mb": 3.574152, '
              '"bytes_up_per_client": 198572.0, "rejected": 0, "knowledge.acc_mean_over_clients": 0.0, '
              '"knowledge.acc_sample_weighted": 0.0, "knowledge.acc_std_over_clients": 0.0, '
              '"model.acc_mean_over_clients": 0.5, "model.acc_sample_weighted": 0.5, '
              '"model.acc_std_over_clients": 0.408248290463863, "time_s": 1.9615671710016613, '
              '"time_client_update_s": 1.1716210880003928, "time_aggregate_s": 0.03373881099832943, '
              '"time_evaluate_s": 0.6680803009985539, "time_engine_s": 0.08812697100438527}')


@pytest.mark.parametrize("line", [FULL, PLAIN, TWO_MODELS], ids=["full", "plain", "two-models"])
def test_a_row_reads_back_into_the_record_that_writes_it_byte_for_byte(line):
    row = json.loads(line)
    record = RoundRecord.from_row(row)
    assert json.dumps(record.as_row()) == line  # keys, their order and every value
    assert RoundRecord.from_row(record.as_row()) == record


def test_the_record_holds_the_counters_and_the_accuracies_by_model_name():
    record = RoundRecord.from_row(json.loads(FULL))
    assert (record.round, record.sampled, record.failed, record.participated, record.rejected) == (2, 3, 1, 2, 1)
    assert record.rejected_reasons == {1: "payload from client 1: payload.meta.extra: not allowed"}
    assert record.lost == {2: "node 7 timed out"} and record.round_failed and record.n_samples_overridden == [0]
    assert record.cum_mb == pytest.approx(6.655984) and record.bytes_up_per_client == 1331216.0
    assert record.time_engine_s == 0.05582168099863338
    ev = record.evaluation
    assert list(ev.accuracies) == ["model", "model@global"] and ev.means == {"model.loss": 0.25}
    assert ev.accuracies["model"] == ModelAccuracy(0.25, 0.25, 0.25, 0.0, 0.16666666666666666)
    assert (ev.trained_clients, ev.untrained_clients, ev.lost) == (1, 1, {0: "node 3 failed"})
    assert record.mean_accuracy() == 0.25 and record.mean_accuracy("model@global") == 0.1
    assert record.mean_accuracy("proto") is None
    plain = RoundRecord.from_row(json.loads(PLAIN))
    assert plain.evaluation is None and plain.accuracies == {} and plain.mean_accuracy() is None
    assert ev.accuracy_row() == {k: v for k, v in record.as_row().items() if ".acc_" in k}


def test_a_record_built_by_its_fields_writes_the_row_in_order():
    """The engine fills a record by its fields, in any order: the row lists the models and the
    clients by name and id."""
    record = RoundRecord(round=4, sampled=5, failed=1, bytes_up=10, bytes_down=20, cum_bytes_up=30, cum_bytes_down=40,
                         rejected_reasons={12: "b", 3: "a"}, bytes_rejected=7, lost={9: "x", 2: "y"},
                         evaluation=RoundEvaluation(accuracies={"proto": ModelAccuracy(0.5, 0.5, 0.0),
                                                                "model": ModelAccuracy(0.25, 0.25, 0.0)},
                                                    means={"z.loss": 1.0, "a.loss": 2.0}),
                         time_s=3.0, time_client_update_s=1.0, time_aggregate_s=0.5, time_evaluate_s=0.25)
    row = record.as_row()
    assert list(row) == [*COUNTERS, "rejected_reasons", "bytes_rejected", "lost",
                         "model.acc_mean_over_clients", "model.acc_sample_weighted", "model.acc_std_over_clients",
                         "proto.acc_mean_over_clients", "proto.acc_sample_weighted", "proto.acc_std_over_clients",
                         "a.loss.mean", "z.loss.mean", *TIMES]
    assert list(row["rejected_reasons"]) == ["3", "12"] and list(row["lost"]) == ["2", "9"]
    # bytes_up counts the 2 accepted uploads (the refused ones are bytes_rejected): 10 / 2
    assert (row["participated"], row["rejected"], row["cum_mb"], row["bytes_up_per_client"]) == (4, 2, 7e-05, 5.0)
    assert row["time_engine_s"] == 1.25
    assert RoundRecord.from_row(row).as_row() == row
    # a row that divided the accepted bytes by every upload (2.5) still loads: a run folder resumes
    assert RoundRecord.from_row({**row, "bytes_up_per_client": 2.5}).bytes_up_per_client == 5.0


def test_a_row_that_is_no_round_record_is_refused():
    row = json.loads(PLAIN)
    with pytest.raises(ValueError, match="'model.acc' is no key of a round's record"):
        RoundRecord.from_row({**row, "model.acc": 0.5})
    with pytest.raises(ValueError, match="participated is 3 in the row, but 1 from its other values"):
        RoundRecord.from_row({**row, "participated": 3})
    with pytest.raises(ValueError, match="without bytes_down"):
        RoundRecord.from_row({k: v for k, v in row.items() if k != "bytes_down"})


def test_round_figure_names_the_model_and_the_figure():
    assert round_figure("proto@global.acc_sample_weighted") == ("proto@global", "acc_sample_weighted")
    assert round_figure("model.acc_untrained_sample_weighted") == ("model", "acc_untrained_sample_weighted")
    assert round_figure("model.acc_all_sample_weighted") == ("model", "acc_all_sample_weighted")
    assert round_figure("model.acc") is None and round_figure("cum_mb") is None
    assert round_figure(".acc_sample_weighted") is None


class _Keeper:
    """An observer that keeps what the engine told it."""

    def __init__(self):
        self.rounds, self.history = [], None

    def round_done(self, history):
        self.rounds.append(list(history))

    def run_done(self, history, summary):
        self.history = list(history)


def test_a_run_writes_its_records_rows_and_a_resumed_run_reads_them_back(tiny, tmp_path):
    from rafl.federation.algorithms.fedavg import FedAvg
    from rafl.federation.build import build_federation
    from rafl.federation.engine import Engine, EngineConfig
    from rafl.reports.run import RunReport

    space, supernet, ds, part = tiny

    def fed():
        return build_federation(ds, part, supernet, [space.smallest()] * 3, FedAvg(local_epochs=1), batch_size=16,
                                count_macs=False)[0]

    keeper = _Keeper()
    (tmp_path / "a").mkdir()
    summary = Engine(fed(), EngineConfig(rounds=2, clients_per_round=2, seed=0), tmp_path / "a", progress=False,
                     observers=[RunReport(tmp_path / "a"), keeper]).run()
    assert all(isinstance(r, RoundRecord) for r in keeper.history) and [len(h) for h in keeper.rounds] == [1, 2]
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert lines == [json.dumps(r.as_row()) for r in keeper.history]
    last = keeper.history[-1]
    assert list(json.loads(lines[-1]))[:len(COUNTERS)] == list(COUNTERS) and list(json.loads(lines[-1]))[-5:] == list(TIMES)
    assert summary["final"] == last.evaluation.accuracy_row() and summary["rounds"] == 2
    assert summary["best_round_model_acc_mean_over_clients"] == max(r.mean_accuracy() for r in keeper.history)
    assert summary["time_s"] == sum(r.time_s for r in keeper.history)
    # the same run stopped after round 1 and resumed: its first record comes back from the checkpoint
    (tmp_path / "b").mkdir()
    Engine(fed(), EngineConfig(rounds=1, clients_per_round=2, seed=0), tmp_path / "b", progress=False,
           observers=[RunReport(tmp_path / "b")]).run()
    first = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    resumed = _Keeper()
    Engine(fed(), EngineConfig(rounds=2, clients_per_round=2, seed=0), tmp_path / "b", progress=False,
           observers=[RunReport(tmp_path / "b"), resumed]).run(resume=True)
    assert isinstance(resumed.rounds[0][0], RoundRecord) and len(resumed.rounds[0]) == 2
    again = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [list(json.loads(x)) for x in again] == [list(json.loads(x)) for x in lines]

    def no_times(line):
        return {k: v for k, v in json.loads(line).items() if k not in TIMES}

    assert [no_times(x) for x in again] == [no_times(x) for x in lines]
    # the resumed round's record: the checkpoint's row (written before the round's final timing)
    assert no_times(again[0]) == no_times(first[0])
    # a checkpoint whose history holds a key no round record has: one line naming the checkpoint, nothing run
    from rafl.errors import UserInputError
    from rafl.federation.store import load_state, save_state

    ck = load_state(tmp_path / "b" / "checkpoint.safetensors")
    ck["history"] = json.dumps([{**json.loads(again[0]), "foreign": 1}])
    save_state(tmp_path / "b" / "checkpoint.safetensors", ck)
    with pytest.raises(UserInputError, match=r"checkpoint\.safetensors: history: 'foreign' is no key .*allowed: a "
                                             r"checkpoint this rafl version wrote"):
        Engine(fed(), EngineConfig(rounds=3, clients_per_round=2, seed=0), tmp_path / "b", progress=False).run(resume=True)
