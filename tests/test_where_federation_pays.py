"""bench/where_federation_pays.py: bad input refused (one line, exit 2, nothing written), its budget, and its
summary and figure from a small fake result set (no training)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import where_federation_pays as wfp  # noqa: E402


@pytest.mark.parametrize("argv,match", [
    (["--pools", "7000"], "--pools: [7000] not allowed; allowed: 5000, 20000"),
    (["--per-client", "5"], "--per-client: 5; allowed: integers >= 20"),
    (["--htfl", "fedavg"], "--htfl: 'fedavg'; allowed: fedgh, fedtgp, fedproto"),
    (["--methods", "standalone,uniform"], "pretrained and standalone must be in it"),
    (["--methods", "pretrained,standalone,rafl+wide"], "unknown variant 'wide'"),
    (["--participation", "0"], "allowed: rounds >= 1, participation in (0, 1]"),
    (["--data-root", "/nonexistent/cifar10"], "--data-root /nonexistent/cifar10: no such file or folder"),
    (["--methods", "pretrained,standalone,fedgx"], "unknown algorithm 'fedgx'"),
    (["--methods", "pretrained,standalone,fedgh+kw1"], "'fedgh+kw1': fedgh has no hyperparameter knowledge_width"),
    (["--alpha", "nan"], "allowed: alpha a finite number > 0"),
    (["--local-epochs", "0"], "local epochs >= 1"),
    (["--grid", "abc"], "--grid 'abc': allowed: comma-separated learning rates"),
    (["--grid", "0.01,-1"], "each a finite number > 0"),
    (["--set", "bogus"], "--set 'bogus': allowed: KEY=VALUE"),
    (["--per-client", "30000"], "allowed: --per-client <= 9000"),
    (["--from", "/nonexistent/runs"], "--from /nonexistent/runs: no finished comparison"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, argv, match):
    res = subprocess.run([sys.executable, str(REPO / "bench" / "where_federation_pays.py"), "--out", str(tmp_path / "o"),
                          "--results", str(tmp_path / "r"), *argv], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and match in res.stderr, res.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_cells_and_budget(tmp_path):
    assert [wfp.cell_clients(5000, p) for p in (90, 450, 1500)] == [500, 100, 30]
    assert [wfp.cell_clients(20000, p) for p in (90, 450, 1500)] == [300, 60, 18]

    class A:
        grid, rounds, participation, local_epochs, lr_from = "0.01,0.03", 10, 0.1, 1, None

    step, score = wfp.SECONDS_PER_IMAGE_STEP, wfp.SECONDS_PER_SCORING
    # one cell: 3 runs x (10 rounds x 8 sampled of 80 trained clients x 450 images + one evaluation of 100
    # clients' own models); the floor: one evaluation of its 3 tiers' models
    assert wfp.budget([5000], [450], ["pretrained", "standalone"], A()) == pytest.approx(
        (3 * (10 * 8 * 450 * step + 100 * score) + 3 * score) / 3600)
    # --lr-from 450: the 90-image cell runs once (40 sampled of 400 trained clients x 90 images, 500 models)
    A.lr_from = 450
    assert wfp.budget([5000], [450, 90], ["pretrained", "standalone"], A()) == pytest.approx(
        (3 * (10 * 8 * 450 * step + 100 * score) + 10 * 40 * 90 * step + 500 * score + 2 * 3 * score) / 3600)
    # a method whose clients of a tier deploy one model: 3 scorings an evaluation
    A.lr_from = None
    assert wfp.budget([5000], [450], ["uniform+sbn"], A()) == pytest.approx(3 * (10 * 8 * 450 * step + 3 * score) / 3600)

    # a cell-method finished in --out counts nothing
    A.out = tmp_path
    (tmp_path / "pool5000-pc450" / "uniform+sbn").mkdir(parents=True)
    (tmp_path / "pool5000-pc450" / "uniform+sbn" / "compare.json").write_text("{}")
    assert wfp.budget([5000], [450], ["uniform+sbn"], A()) == 0


def test_a_pick_at_the_edge_of_the_grid_extends_it_by_one_half_decade_step():
    assert wfp.wider([0.01, 0.03, 0.1], 0.01) == [0.01, 0.03, 0.1, 0.003]
    assert wfp.wider([0.01, 0.03, 0.1], 0.1) == [0.01, 0.03, 0.1, 0.3]
    assert wfp.wider([0.01, 0.03, 0.1, 0.003], 0.003) == [0.01, 0.03, 0.1, 0.003, 0.001]
    assert wfp.wider([0.01, 0.03, 0.1], 0.03) is None  # inside
    assert wfp.wider([0.05], 0.05) is None  # one value: no edge to leave; not on the ladder either
    assert wfp.wider([0.0001, 0.001], 0.0001) is None  # the ladder's end


def test_a_cells_settings_give_local_epochs_to_the_trained_methods_only():
    """The floor (`pretrained`) has no hyperparameters: `rafl compare` refuses algorithm.local_epochs for it."""
    class A:
        rounds, participation, alpha, seed, local_epochs = 200, 0.1, 0.1, 0, 1

    floor, trained = wfp.cell_sets(5000, 90, A(), "pretrained"), wfp.cell_sets(5000, 90, A(), "standalone")
    assert "algorithm.local_epochs=1" not in floor and "algorithm.local_epochs=1" in trained
    assert "supernet=cifar10-proxy5k" in floor and "clients.n=500" in floor
    # each pool's search reads the measurements shipped with its supernet: its whole server-val
    assert "search.val_samples=1000" in floor and "search.val_samples=5000" in wfp.cell_sets(20000, 450, A(), "pretrained")



def test_the_maps_rows_keep_each_methods_own_bn_rule_over_the_configs_server_statistics():
    """The cross-device config deploys with the server pool's BN statistics (its measured choice for ~90-image
    clients); the map's rows start from each method's own rule and only `uniform+sbn` re-estimates on the pool,
    so the shipped cells' rules stay what their tables say."""
    from rafl.federation.run_config import load_run_config

    class A:
        rounds, participation, alpha, seed, local_epochs, htfl = 20, 0.1, 0.1, 0, 1, "fedgh"

    assert load_run_config(wfp.CONFIG).train.bn_statistics == "server"
    for method, rule in (("pretrained", None), ("standalone", None), ("fedgh", None), ("rafl+kw1", None),
                         ("uniform+sbn", "server")):
        args = [*wfp.cell_sets(5000, 90, A(), method), *wfp.method_sets(method, "fedgh")[1]]
        sets = [args[i + 1] for i in range(0, len(args), 2) if args[i] == "--set"]
        assert load_run_config(wfp.CONFIG, sets).train.bn_statistics == rule, method

def _fake(out, pool, per, method, accs, new):
    folder = wfp.cell_dir(out, pool, per, method)
    (folder / method.partition("+")[0]).mkdir(parents=True)
    alg = method.partition("+")[0]
    (folder / "compare.json").write_text(json.dumps({"rows": [{"algorithm": alg, "bn_statistics": "client"}]}))
    if method == "fedgh":  # the comparison's recorded config: the rule it aggregated with
        (folder / "config.yaml").write_text("engine:\n  aggregation: mean\n")
    clients = {str(i): {"model.acc": a, "model@global.acc": a - 0.1} for i, a in enumerate(accs)}
    (folder / alg / "summary.json").write_text(json.dumps({"clients": clients}))
    held = {str(10 + i): {"model.acc": a} for i, a in enumerate(new)}
    (folder / alg / "new_clients.json").write_text(json.dumps({"new_clients": {"clients": held}}))


def test_summary_and_figure_from_a_fake_result_set(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    for pool, per in ((5000, 90), (20000, 1500)):
        _fake(out, pool, per, "pretrained", [0.5, 0.6, 0.7], [0.5, 0.5])
        _fake(out, pool, per, "standalone", [0.4, 0.5, 0.6], [0.3, 0.35])
        _fake(out, pool, per, "fedgh", [0.6, 0.72, 0.79], [0.6, 0.62])
    assert wfp.main(["--from", str(out), "--results", str(results), "--pools", "5000,20000", "--per-client", "90,1500",
                     "--methods", "pretrained,standalone,HTFL"]) == 0
    got = json.loads((results / "where_federation_pays.json").read_text())
    cell = got["cells"][0]
    assert (cell["pool"], cell["per_client"], cell["clients"]) == (5000, 90, 500) and not cell["null_result"]
    assert got["cells"][-1]["null_result"]                               # (20,000, 1,500): the fair headline's cell
    gain = cell["methods"]["fedgh"]["vs_pretrained"]["model@global.acc"]
    assert gain[0] == pytest.approx(100 * (0.7033333 - 0.6), abs=1e-3) and gain[2] == 3 and gain[1] > 0
    new = cell["methods"]["fedgh"]["vs_standalone"]["new"]
    assert new[0] == pytest.approx(28.5) and new[2] == 2
    md = (results / "where_federation_pays.md").read_text()
    assert "null result" in md and "| fedgh | mean | client |" in md and "| standalone | - | client |" in md
    assert "+28.5 ±" in md and cell["methods"]["fedgh"]["aggregation"] == "mean"
    assert (results / "where_federation_pays.png").stat().st_size > 0


def test_a_tuning_at_the_grids_edge_extends_it_at_most_twice_and_keeps_its_last_final_run(tmp_path, monkeypatch):
    """A pick always at the low edge: the grid grows by 0.003 and 0.001, and the third tuning's final
    run stays (it was deleted with nothing run after it); a resumed folder starts from the grid its
    trials reached, not from --grid."""
    calls = []

    def compare(args, folder, algorithm, extra):
        grid = [float(v) for v in extra[extra.index("--tune") + 1].removeprefix("lr=").split(",")]
        calls.append(grid)
        for i, lr in enumerate(grid):
            trial = folder / "tune" / f"trial{i}"
            trial.mkdir(parents=True, exist_ok=True)
            (trial / "config.yaml").write_text(f"algorithms:\n  {algorithm}:\n    lr: {lr}\n")
        pick = grid.index(min(grid))
        (folder / "tune.json").write_text(json.dumps({"picked": {algorithm: {"trial": pick}},
                                                      "trials": {algorithm: [{"hparams": {"lr": v}} for v in grid]}}))
        (folder / "compare.json").write_text("{}")

    monkeypatch.setattr(wfp.fh, "compare", compare)

    class A:
        out, grid, lr_from, htfl = tmp_path, "0.01,0.03,0.1", None, "fedgh"
        rounds, participation, alpha, seed, local_epochs = 20, 0.1, 0.1, 0, 1

    wfp.run_cell(A(), 5000, 450, "standalone")
    assert calls == [[0.01, 0.03, 0.1], [0.01, 0.03, 0.1, 0.003], [0.01, 0.03, 0.1, 0.003, 0.001]]
    folder = wfp.cell_dir(tmp_path, 5000, 450, "standalone")
    assert (folder / "compare.json").is_file() and wfp.picked_lr(folder) == 0.001
    # interrupted after the first extension's trials: the resumed tuning starts from the 4-value grid
    (folder / "compare.json").unlink()
    (folder / "tune.json").unlink()
    for trial in ("trial4",):
        for f in (folder / "tune" / trial).iterdir():
            f.unlink()
        (folder / "tune" / trial).rmdir()
    calls.clear()
    wfp.run_cell(A(), 5000, 450, "standalone")
    assert calls[0] == [0.01, 0.03, 0.1, 0.003] and len(calls) == 2
