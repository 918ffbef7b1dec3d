"""The accuracy figures' names (rafl.federation.metric_keys) are the keys the run files hold: the
literal strings below are the file format."""

from __future__ import annotations

from rafl.federation.metric_keys import (
    MODEL,
    NEW_CLIENTS,
    NEW_CLIENTS_FT,
    ModelKeys,
    client_accuracies,
    counted_models,
    evaluated_models,
    global_count,
    totals,
)


def test_the_names_are_the_file_format():
    assert (MODEL.correct, MODEL.total) == ("model.correct", "model.total")
    assert (MODEL.acc_mean_over_clients, MODEL.acc_sample_weighted, MODEL.acc_std_over_clients) == (
        "model.acc_mean_over_clients", "model.acc_sample_weighted", "model.acc_std_over_clients")
    assert (MODEL.acc_untrained_sample_weighted, MODEL.acc_all_sample_weighted) == (
        "model.acc_untrained_sample_weighted", "model.acc_all_sample_weighted")
    assert (MODEL.acc, MODEL.acc_ft, MODEL.on_global.acc) == ("model.acc", "model.acc_ft", "model@global.acc")
    assert (MODEL.acc_mean, MODEL.acc_std, MODEL.acc_pooled, MODEL.acc_pooled_se, MODEL.acc_mean_last(3),
            MODEL.acc_ft_mean) == ("model.acc_mean", "model.acc_std", "model.acc_pooled", "model.acc_pooled_se",
                                   "model.acc_mean_last3", "model.acc_ft_mean")
    assert ModelKeys("proto").on_global.acc_mean == "proto@global.acc_mean"
    assert (NEW_CLIENTS.acc_mean, NEW_CLIENTS_FT.acc_mean) == ("new.acc_mean", "new-ft.acc_mean")


def test_the_helpers_read_an_evaluation_and_a_round_record():
    counts = {"model.correct": 3.0, "model.total": 4.0, "proto.correct": 0.0, "proto.total": 0.0,
              "model@global.correct": 5.0, "model@global.total": 10.0, "model.loss": 0.5}
    assert counted_models(counts) == ["model", "model@global", "proto"]
    assert client_accuracies(counts) == {"model.acc": 0.75, "proto.acc": None, "model@global.acc": 0.5}
    assert list(client_accuracies(counts)) == ["model.acc", "proto.acc", "model@global.acc"]  # in their order
    assert totals(counts) == {"model": 4.0, "proto": 0.0, "model@global": 10.0}
    assert [global_count(k) for k in ("model.correct", "proto.total", "model.loss")] == [
        "model@global.correct", "proto@global.total", None]
    assert evaluated_models({"round": 1, "proto.acc_mean_over_clients": 0.1, "model.acc_mean_over_clients": 0.2}) == [
        "model", "proto"]
    assert evaluated_models({"round": 1, "cum_mb": 0.0}) == []
