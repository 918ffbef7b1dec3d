"""The fair benchmark's parts: the held-out global test set, both protocols in `rafl compare`, the
no-training floor, the fine-tuned variants, tuning on validation data, the tailoring ablation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from rafl.cli import cli
from rafl.data import Partition, carve_global_test, carve_public_pool, make_partition
from rafl.errors import UserInputError
from rafl.federation.checks import check_clients_avoid_pool, check_disjoint, check_global_test
from rafl.stages.compare import parse_grid, validation_loaders

LABELS = np.repeat(np.arange(4), 30)                       # 4 classes x 30 samples
ORIGIN = np.array((["train"] * 20 + ["test"] * 10) * 4)    # per class: 20 train, 10 test


def test_global_test_set_is_balanced_held_out_and_the_same_for_every_run_seed():
    part = make_partition(LABELS, "dirichlet", 3, seed=0, alpha=0.5, min_samples=5, public_fraction=0.25,
                          origin=ORIGIN, global_test_per_class=5)
    held = part.global_test
    assert np.bincount(LABELS[held]).tolist() == [5, 5, 5, 5]
    assert (ORIGIN[held] == "test").all()                   # the test split only: never the supernet's pool
    clients = np.concatenate([c.all() for c in part.clients])
    assert not np.isin(held, clients).any() and not np.isin(held, part.public).any()
    assert len(clients) + len(part.public) + len(held) == len(LABELS)   # nothing else is lost
    other = make_partition(LABELS, "dirichlet", 3, seed=7, alpha=0.5, min_samples=5, public_fraction=0.25,
                           origin=ORIGIN, global_test_per_class=5)
    np.testing.assert_array_equal(other.global_test, held)   # another run seed scores on the same images
    check_disjoint(part)


def test_global_test_set_survives_a_partition_file_and_an_overlap_is_refused_with_its_count(tmp_path):
    part = make_partition(LABELS, "iid", 2, seed=0, public_fraction=0.25, origin=ORIGIN, global_test_per_class=3)
    path = tmp_path / "partition.json"
    part.save(path)
    back = Partition.load(path, n_samples=len(LABELS))
    np.testing.assert_array_equal(back.global_test, part.global_test)
    obj = json.loads(path.read_text())
    obj["global_test"] = obj["global_test"][:-2] + obj["clients"]["0"]["train"][:2]   # 2 client samples
    path.write_text(json.dumps(obj))
    with pytest.raises(UserInputError, match=r"overlaps the public pool and client splits in 2 sample"):
        Partition.load(path, n_samples=len(LABELS))


def test_a_global_test_set_inside_the_supernets_pool_is_refused_naming_the_count():
    part = make_partition(LABELS, "iid", 2, seed=0, public_fraction=0.25, origin=ORIGIN, global_test_per_class=3)
    pool = carve_public_pool(LABELS, 0.25, 0, ORIGIN)
    check_global_test(part, pool)                            # disjoint: fine
    part.global_test = np.sort(np.concatenate([part.global_test[:-1], pool[:1]]))
    with pytest.raises(UserInputError, match=r"overlaps client data in 0 sample\(s\) and the supernet's public pool "
                                             r"in 1"):
        check_global_test(part, pool)
    with pytest.raises(UserInputError, match="public pool in 1"):
        check_clients_avoid_pool(part, LABELS, (0.25, 0), "partition.json", ORIGIN)


def test_global_test_set_larger_than_a_class_is_refused():
    with pytest.raises(UserInputError, match=r"class 0 has only 10 samples to hold out; allowed: 0..10"):
        carve_global_test(LABELS, 11, 0, ORIGIN)
    assert len(carve_global_test(LABELS, 0, 0, ORIGIN)) == 0


def test_validation_loaders_score_on_val():
    swapped = validation_loaders(lambda cid, split, seed: f"{split}-{cid}")
    assert swapped(1, "test", 0) == "val-1" and swapped(1, "train", 0) == "train-1"
    with pytest.raises(UserInputError, match="no validation split"):
        validation_loaders(lambda cid, split, seed: None)(0, "test", 0)


def test_tuning_grid_gives_every_method_the_same_budget_and_checks_each_value():
    hp = {"standalone": {"lr": 0.05, "local_epochs": 1}, "fedgh": {"lr": 0.05, "local_epochs": 1},
          "pretrained": {}}
    trials = parse_grid(["lr=0.01,0.1"], hp)
    assert set(trials) == {"standalone", "fedgh"}           # the floor has nothing to tune
    assert [t["lr"] for t in trials["fedgh"]] == [0.01, 0.1] and trials["fedgh"][0]["local_epochs"] == 1
    with pytest.raises(UserInputError, match="different budgets"):
        parse_grid(["lr=0.01,0.1", "fedgh.server_lr=0.1,1"], hp)
    for bad in ("lr=", "lr", "=0.1"):
        with pytest.raises(UserInputError, match="KEY=V1,V2"):
            parse_grid([bad], hp)
    with pytest.raises(UserInputError, match=r"lr is -1; allowed: a number > 0 \(for standalone\)"):
        parse_grid(["lr=-1,0.1"], hp)
    with pytest.raises(UserInputError, match="no compared method has"):
        parse_grid(["nosuch=1,2"], hp)


@pytest.mark.parametrize("tune", ["--tune=lr=", "--tune=lr=-0.5,0.1"])
def test_compare_refuses_a_bad_tuning_grid_with_one_line_and_exit_2(tmp_path, tune):
    res = CliRunner().invoke(cli, ["compare", "--no-progress", "--models", "cnn4-small", "--out", str(tmp_path / "o"),
                                   "--algorithms", "standalone,fedavg", tune])
    assert res.exit_code == 2, res.output
    assert "--tune" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def test_compare_scores_both_protocols_with_a_floor_and_a_finetuned_row(tmp_path):
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--no-progress", "--models", "cnn4-small", "--out", str(out),
                                   "--algorithms", "pretrained,fedavg", "--set", "data.limit_per_class=20",
                                   "--set", "clients.n=3", "--set", "partition.global_test_per_class=4",
                                   "--set", "partition.min_samples=5", "--set", "algorithm.local_epochs=1",
                                   "--set", "engine.rounds=2", "--tune", "lr=0.01,0.05"])
    assert res.exit_code == 0, res.output
    rows = {r["algorithm"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    assert list(rows) == ["pretrained", "fedavg", "fedavg-ft"]
    assert rows["pretrained"]["mb_total"] == 0 and rows["fedavg-ft"]["mb_total"] == rows["fedavg"]["mb_total"]
    # the floor never changes: evaluated once, after the last round (fedavg at every round, eval_every 1)
    evaluated = {m: [r["round"] for r in map(json.loads, (out / m / "metrics.jsonl").read_text().splitlines())
                     if "model.acc_mean_over_clients" in r] for m in ("pretrained", "fedavg")}
    assert evaluated == {"pretrained": [2], "fedavg": [1, 2]}
    assert rows["pretrained"]["model.acc_mean_last3"] == rows["pretrained"]["model.acc_mean"]
    for r in rows.values():
        assert 0 <= r["model.acc_mean"] <= 1 and 0 <= r["model@global.acc_mean"] <= 1
    summary = json.loads((out / "fedavg" / "summary.json").read_text())["clients"]
    assert {c["global_test_samples"] for c in summary.values()} == {40}      # 10 classes x 4
    assert len({c["model@global.acc"] for c in summary.values()}) == 1        # one global model for all
    tuned = json.loads((out / "tune.json").read_text())
    assert set(tuned["trials"]) == {"fedavg"} and len(tuned["trials"]["fedavg"]) == 2
    assert rows["fedavg"]["settings"] in ("lr=0.01", "")     # the pick is the run's lr (0.05 is the default)
    assert "global acc" in (out / "compare.md").read_text()


@pytest.mark.slow
def test_weakest_subnets_put_every_client_on_the_uniform_subnet(tmp_path, tiny_supernet):
    path, _ = tiny_supernet
    out = tmp_path / "cmp"
    base = ["compare", "--no-progress", "--models", "nas", "--algorithms", "standalone", "--set",
            f"supernet.path={path}", "--set", "data.limit_per_class=10", "--set", "clients.n=4",
            "--set", "clients.profiles=[pi4, phone]", "--set", "algorithm.local_epochs=1", "--set", "engine.rounds=1",
            "--set", "search.method=largest-feasible", "--set", "search.samples=30"]
    tailored = CliRunner().invoke(cli, [*base, "--out", str(out / "a")])
    pinned = CliRunner().invoke(cli, [*base, "--out", str(out / "b"), "--set", "clients.subnets=weakest"])
    assert tailored.exit_code == 0 and pinned.exit_code == 0, tailored.output + pinned.output
    a = json.loads((out / "a" / "standalone" / "clients.json").read_text())["clients"]
    b = json.loads((out / "b" / "standalone" / "clients.json").read_text())["clients"]
    assert len({r["arch"] for r in b}) == 1
    pi4 = {r["arch"] for r in a if r["profile"] == "pi4"}
    assert {r["arch"] for r in b} <= pi4 | {r["arch"] for r in a}


def _fair_headline():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "fair_headline.py"
    spec = importlib.util.spec_from_file_location("fair_headline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_fair_headline_variants_run_apart_and_keep_their_own_row_names(tmp_path):
    """``heterofl+sbn`` runs heterofl with static BN's server statistics in its own comparison; its
    rows (and -ft row) are named apart from plain heterofl's; an unknown variant is refused."""
    fh = _fair_headline()
    assert fh.variant_sets("heterofl") == ("heterofl", [])
    assert fh.variant_sets("rafl+kw1") == ("rafl", ["--set", "algorithm.rafl.knowledge_width=1"])
    algorithm, sets = fh.variant_sets("fedrolex+sbn")
    assert algorithm == "fedrolex"
    assert sets == ["--set", "algorithm.fedrolex.static_bn=true", "--set", "algorithm.fedrolex.sbn_statistics=server"]
    with pytest.raises(SystemExit, match="unknown variant 'bn'.*allowed: sbn, kw1"):
        fh.variant_sets("heterofl+bn")
    for folder, rows in (("seed0-heterofl", ["heterofl", "heterofl-ft"]),
                         ("seed0-heterofl+sbn", ["heterofl", "heterofl-ft"]),
                         ("seed0-weakest-heterofl+sbn", ["heterofl"])):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "compare.json").write_text(json.dumps({"rows": [{"algorithm": r} for r in rows]}))
    found = fh.runs(tmp_path, "seed0")
    assert sorted(found) == ["heterofl", "heterofl+sbn", "heterofl+sbn-ft", "heterofl-ft"]
    assert found["heterofl+sbn-ft"][1].name == "seed0-heterofl+sbn"
    assert found["heterofl+sbn"][0]["algorithm"] == "heterofl"
    assert sorted(fh.runs(tmp_path, "seed0-weakest")) == ["heterofl+sbn"]


def test_fair_headline_tune_seeds_runs_the_other_seeds_with_the_tuning_seeds_pick(tmp_path, monkeypatch, capsys):
    """``--tune-seeds 0``: seed 0 tunes; seed 1 (and its ablation) run once with seed 0's picked lr, after
    seed 0's jobs; a method seed 0 has not tuned is refused by name; ``--tune-seeds`` needs --jobs."""
    fh = _fair_headline()
    calls: list[tuple[str, list[str]]] = []

    def fake_compare(args, out, methods, extra):
        calls.append((out.name, extra))
        out.mkdir(parents=True, exist_ok=True)
        if "--tune" in extra:
            (out / "tune.json").write_text(json.dumps({"picked": {methods: {"lr": 0.03}}}))

    monkeypatch.setattr(fh, "compare", fake_compare)
    monkeypatch.setattr(fh, "summarize", lambda args, seeds: "")
    fh.main(["--out", str(tmp_path), "--seeds", "0,1", "--tune-seeds", "0", "--jobs", "2",
             "--methods", "standalone,fedtgp", "--ablation", "standalone"])
    order = [name for name, _ in calls]
    assert set(order[:3]) == {"seed0-standalone", "seed0-weakest-standalone", "seed0-fedtgp"}
    assert set(order[3:]) == {"seed1-standalone", "seed1-weakest-standalone", "seed1-fedtgp"}
    extra = dict(calls)
    assert "--tune" in extra["seed0-standalone"] and "--tune" in extra["seed0-fedtgp"]
    assert "algorithm.standalone.lr=0.03" in extra["seed0-weakest-standalone"]
    for name, algorithm in (("seed1-standalone", "standalone"), ("seed1-fedtgp", "fedtgp"),
                            ("seed1-weakest-standalone", "standalone")):
        assert "--tune" not in extra[name]
        assert f"algorithm.{algorithm}.lr=0.03" in extra[name] and "seed=1" in extra[name]
    assert fh.picked_lr(tmp_path / "seed0-fedtgp", "fedtgp") == 0.03
    assert fh.picked_lr(tmp_path / "seed1-fedtgp", "fedtgp") is None

    calls.clear()
    fh.main(["--out", str(tmp_path / "b"), "--seeds", "1", "--tune-seeds", "0", "--jobs", "1", "--methods", "fedtgp"])
    assert calls == []
    assert "seed1-fedtgp: seed 0 has not tuned fedtgp" in capsys.readouterr().out
    for bad in (["--tune-seeds", "0"], ["--tune-seeds", "", "--jobs", "1"]):  # no --jobs; no seed
        with pytest.raises(SystemExit) as err:
            fh.main(["--out", str(tmp_path), "--seeds", "0,1", "--methods", "standalone", *bad])
        assert err.value.code == 2 and "--tune-seeds: give at least one seed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        fh.main(["--out", str(tmp_path), "--seeds", "0", "--methods", "rafl+kw2", "--jobs", "1"])
    assert err.value.code == 2 and "unknown variant 'kw2' in 'rafl+kw2'; allowed: sbn, kw1" in capsys.readouterr().err


def test_fair_headline_with_a_failed_comparison_exits_1_and_leaves_the_results_alone(tmp_path, monkeypatch, capsys):
    fh = _fair_headline()

    def failing(args, out, methods, extra):
        raise SystemExit(f"{out.name}: rafl compare failed (exit 2); see {out.name}.log")

    monkeypatch.setattr(fh, "compare", failing)
    results = tmp_path / "results"
    results.mkdir()
    assert fh.main(["--out", str(tmp_path / "runs"), "--seeds", "0", "--methods", "standalone", "--jobs", "1",
                    "--results", str(results)]) == 1
    assert "seed0-standalone: rafl compare failed" in capsys.readouterr().out
    assert list(results.iterdir()) == []
    with pytest.raises(SystemExit, match="nothing to summarize: no method has finished for seed"):
        fh.main(["--from", str(tmp_path / "runs"), "--seeds", "0", "--methods", "standalone", "--results", str(results)])
    assert list(results.iterdir()) == []


def test_fair_headline_summary_names_whose_pick_a_seed_ran_with(tmp_path):
    """The summary's lr column: the tuning seed's pick and grid; for a seed that ran with it, whose pick it was."""
    fh = _fair_headline()
    for seed in (0, 1):
        for method in ("pretrained", "standalone"):
            folder = tmp_path / f"seed{seed}-{method}"
            (folder / method).mkdir(parents=True)
            gain = (0.01 + 0.03 * seed) if method == "standalone" else 0.0  # +1 point on seed 0, +4 on seed 1
            clients = {str(c): {"model.acc": 0.5 + 0.1 * c + 0.01 * seed + gain, "model@global.acc": 0.4}
                       for c in range(3)}
            (folder / method / "summary.json").write_text(json.dumps({"clients": clients}))
            row = {"algorithm": method, "model.acc_mean": 0.6, "model.acc_mean_last3": 0.6,
                   "model@global.acc_mean": 0.4, "model@global.acc_mean_last3": 0.4}
            (folder / "compare.json").write_text(json.dumps({"rows": [row]}))
    (tmp_path / "seed0-standalone" / "tune.json").write_text(json.dumps({
        "picked": {"standalone": {"lr": 0.01}},
        "trials": {"standalone": [{"hparams": {"lr": lr}, "val_acc": acc} for lr, acc in ((0.01, 0.7), (0.1, 0.6))]}}))
    args = fh.argparse.Namespace(out=tmp_path, methods="pretrained,standalone", ablation="", grid="0.01,0.1",
                                 smoke=True, tune_seeds="0", results=tmp_path / "new" / "results")
    text = fh.summarize(args, [0, 1])
    line = next(x for x in text.splitlines() if x.startswith("| standalone |"))
    assert "0.01 of 0.01/0.1 / 0.01 (seed 0's)" in line
    assert "| pretrained |" in text and "- / -" in next(x for x in text.splitlines() if x.startswith("| pretrained |"))
    assert (tmp_path / "new" / "results" / "headline_fair_smoke.png").stat().st_size > 0
    assert "(headline_fair_smoke.png)" in text
    header = next(x for x in text.splitlines() if x.startswith("| method | seed 0 personalized"))
    assert header.endswith("| over seeds personalized | over seeds global |")
    # over 2 seeds: +1 and +4 points, SE 1.5, t(0.975, 1) = 12.71: ± 19.1, no mark
    assert next(x for x in text.splitlines() if x.startswith("| standalone | +")).endswith("| +2.5 ± 19.1 | +0.0 ± 0.0 |")
    again = fh.render(json.loads((tmp_path / "new" / "results" / "headline_fair_smoke.json").read_text()),
                      tmp_path / "again")
    assert again == text                                     # the JSON alone re-renders the same summary
    assert "| norm_clip |" in line                           # the aggregation rule each row ran under


def test_fair_headline_over_seeds_is_the_mean_of_the_seeds_differences_with_their_t_interval():
    """Over seeds: mean of per-seed paired differences ± t(0.975, k-1) x SE over seeds; one seed has none."""
    fh = _fair_headline()
    assert fh.seeds_flag([0.01, 0.02, 0.03]) == "+2.0 ± 2.5"  # SE 0.58 points x 4.30: 2 SE would have marked it
    assert fh.seeds_flag([0.05, 0.06, 0.07]) == "+6.0 ± 2.5 *"  # the interval excludes 0: marked
    assert fh.seeds_flag([0.02]) == "-" and fh.seeds_flag([float("nan"), 0.02]) == "-"
    assert fh.flag(0.03, 0.01, 20) == "+3.0 ± 2.1 *" and fh.flag(0.03, 0.01, 3) == "+3.0 ± 4.3"  # over clients


def test_fair_headline_curves_plot_the_weight_sharing_methods_global_accuracy_by_round(tmp_path):
    """One panel per seed from each weight-sharing method's metrics.jsonl; nothing written without one."""
    fh = _fair_headline()
    where, rows = {}, {}
    for seed in (0, 1):
        (tmp_path / f"s{seed}" / "fedrolex").mkdir(parents=True)
        log = [{"round": r, "model@global.acc_mean_over_clients": 0.7 + 0.01 * r} for r in (2, 4)] + [{"round": 3}]
        (tmp_path / f"s{seed}" / "fedrolex" / "metrics.jsonl").write_text("\n".join(map(json.dumps, log)) + "\n")
        where[seed] = {"fedrolex+sbn": tmp_path / f"s{seed}", "fedtgp": tmp_path / "none"}
        rows[seed] = {"fedrolex+sbn": {"algorithm": "fedrolex"}, "fedtgp": {"algorithm": "fedtgp"},
                      "pretrained": {"model@global.acc_mean": 0.72}}
    weakest = {0: {"pretrained": ({"model@global.acc_mean": 0.71}, tmp_path)}}
    png = tmp_path / "curves.png"
    assert fh.curves(png, where, rows, [0, 1], ["pretrained", "fedrolex+sbn", "fedrolex+sbn-ft", "fedtgp"], weakest)
    assert png.stat().st_size > 0
    assert not fh.curves(tmp_path / "no.png", where, rows, [0, 1], ["pretrained", "fedtgp"], weakest)
    assert not (tmp_path / "no.png").exists()
