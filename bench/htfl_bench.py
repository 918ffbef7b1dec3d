"""HtFL bench: FedGH, FedTGP, FedProto vs Standalone on pathological / Dirichlet non-IID data,
and the exact upload size of the prototype methods against their formulas.

Scenarios (one partition per scenario and seed, every method on the same client models: the
``htfe-tiny`` heterogeneous group, round-robin, D = 64):

* digits (sklearn's 8x8 digits upscaled to 32x32), pathological 2 classes of 10, 20 clients;
* the same with 20% of each client's samples for training instead of 75% (``digits-pat2-train20``:
  Standalone is saturated at ~0.98 on the first, which leaves no room to measure a gain);
* a CIFAR-10 subset (the shared JPEG set, ``limit_per_class`` images per class), pathological 2/10;
* the same subset, Dirichlet alpha = 0.1, every client holding >= 40 samples (HtFLlib's rule).

Claims checked (printed as PASS/FAIL, never asserted so the numbers are always written), on the
mean over seeds of each run's accuracy averaged over its last ``--tail`` rounds (a single round's
mean client accuracy moves by 1-3 points: ~60 test images per client): FedGH > Standalone,
FedTGP > Standalone, FedTGP >= FedProto (head accuracy, and nearest-prototype accuracy: the
protocol of the FedProto/FedTGP papers and HtFLlib), and FedGH's two other inference rules of the
same runs > Standalone (``label_prior: local``; ``deploy_header: local``); each also on the pooled
accuracy (all clients' test samples together: HtFLlib's "Averaged Test Accuracy"). Beside them the paired
per-seed differences (every method of a seed runs on the same partition) with the number of seeds
on which each holds. Every round and seed: the measured upload
bytes (``Payload.nbytes()`` summed by the engine) = the formula bytes + the safetensors header:
FedGH / FedTGP ``(S + S*r) x 32`` bits per client (S classes held, r = D), FedProto
``(2S + S*r) x 32`` (its per-class counts, Eq. 6).

Run: ``python bench/htfl_bench.py [--rounds 30] [--seeds 0,1] [--only cifar10-pat2] [--jobs 2] --out DIR``;
writes ``bench/results/htfl_bench[_<only>][_rounds<R>][_limit<N>].md`` and ``.json``, and prints one line per method and
seed as it finishes. Each method run takes 4-8 min per CIFAR-10 scenario and seed at 30 rounds on one
core (single-threaded torch), 1-4 min on digits; run scenarios as separate processes (``--only``) or
seeds in parallel (``--jobs``) to use more cores. Results are cached per method and seed under
``DIR`` (:func:`run_seed`), so a rerun with more seeds, or after one method changed, only runs what is
missing. A method whose training diverges (rafl stops it with an error naming the client and model)
is a result, not a crash: the report lists it with its round and error, leaves it out of the means,
and makes each comparison on the seeds where both methods completed (saying which were left out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from rafl.errors import UserInputError
from rafl.federation.payload import Payload
from rafl.federation.prototypes import to_payload_tensors
from rafl.io import atomic_write_json, atomic_write_text
from rafl.reports.compare import read_history
from rafl.stages.compare import load_compare_config, run_compare
from rafl.stages.prepare import load_data_and_partition

ROOT = Path(__file__).resolve().parents[1]
CIFAR = ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"
METHODS = ["standalone", "fedgh", "fedtgp", "fedproto"]
MODELS = "htfe-tiny"
UPLOAD_PREFIX = {"fedgh": ("lar.", 1), "fedtgp": ("proto.", 1), "fedproto": ("proto.", 2)}
# the inference rules whose accuracy a run reports: ``model`` (the deployed model), ``proto``
# (nearest global prototype: FedProto, FedTGP), ``prior`` and ``local`` (FedGH's global header plus
# the client's log label prior, and the header from the client's last local training)
RULES = ("model", "proto", "prior", "local")
# the smallest client of the Dirichlet scenario (``--dir-min-samples``): HtFLlib's generator redraws until
# every client holds batch_size / (1 - train_ratio) = 10 / 0.25 samples (dataset_utils.separate_data,
# ``least_samples``)
DIRICHLET_MIN_SAMPLES = 40
# rounds per window of the report's accuracy-gap-by-round table (:func:`gap_by_window`)
WINDOW = 10
# bump a method's version when its training or evaluation changes, so cached results are re-measured
METHOD_VERSION = {"fedgh": 2}  # 2: reports the local header (local.*)


def expected_upload(method: str, held: list[int], dim: int) -> tuple[int, int]:
    """``(formula bytes, safetensors header bytes)`` of one client's upload holding classes ``held``."""
    prefix, label_vectors = UPLOAD_PREFIX[method]
    s = len(held)
    formula_bits = (label_vectors * s + s * dim) * 32
    tensors = to_payload_tensors({c: torch.zeros(dim) for c in held}, prefix)
    if method == "fedproto":
        tensors[prefix + "counts"] = torch.zeros(s, dtype=torch.int32)
    blob = Payload(tensors).to_bytes()
    return formula_bits // 8, len(blob) - formula_bits // 8


def _tail_mean(hist: list[dict], key: str, tail: int) -> float | None:
    vals = [h[key] for h in hist[-tail:] if key in h]
    return sum(vals) / len(vals) if vals else None


def _method_sets(overrides: list[str], rounds: int, seed: int, device: str) -> list[str]:
    """The bench's common settings, then the scenario's ``overrides`` (which win)."""
    return [f"seed={seed}", f"engine.rounds={rounds}", "engine.target_accuracy=null", "train.threads=1",
            f"train.device={device}", "train.batch_size=10", "partition.public_fraction=0.0",
            "partition.split=[0.75,0.0,0.25]", "algorithm.local_epochs=1", "algorithm.lr=0.01"] + overrides


def run_method(name: str, method: str, cfg, hparams: dict, held: list[list[int]], out: Path, dim: int, seed: int,
               tail: int, tag: str | None = None) -> dict:
    """One method on one scenario/seed: its compare row with the tail accuracies and its curve, and
    (prototype methods) the upload-bytes rows and check. ``tag`` names the run dir (default: the
    method), so variants of one method (``bench/fedgh_sweep.py``) do not share it."""
    run_out = out / name / f"seed{seed}" / (tag or method)
    shutil.rmtree(run_out, ignore_errors=True)  # a run of other settings, or one interrupted: start afresh
    t0 = time.perf_counter()
    try:
        (row,) = run_compare(cfg, {method: hparams}, run_out, models=MODELS, feature_dim=dim, progress=False)
    except UserInputError as err:
        if "diverged" not in err.message:
            raise
        # a diverged method is a result of the bench, not a crash of it: recorded, reported, and
        # left out of the means (its accuracies are None)
        hist = read_history(run_out / method)
        row = {"method": method, "diverged": str(err), "diverged_round": len(hist) + 1,
               "model.acc_mean": None, "model.acc_std": None, "mb_up": None, "mb_total": None}
        print(f"  {name} seed {seed} {tag or method:<11} DIVERGED in round {len(hist) + 1}: {err}", flush=True)
    else:
        hist = read_history(run_out / method)
    row |= {"wall_s": time.perf_counter() - t0,
            "curve": [round(h["model.acc_mean_over_clients"], 4) for h in hist]}
    for rule in RULES:
        row[f"{rule}.acc_tail"] = None if "diverged" in row else _tail_mean(hist, f"{rule}.acc_mean_over_clients", tail)
        # HtFLlib's / PFLlib's "Averaged Test Accuracy": all clients' correct / all their test samples
        row[f"{rule}.acc_tail_pooled"] = (None if "diverged" in row
                                          else _tail_mean(hist, f"{rule}.acc_sample_weighted", tail))
    if "diverged" not in row:
        extra = "".join(f"  {rule} {row[f'{rule}.acc_tail']:.4f}" for rule in RULES[1:]
                        if row[f"{rule}.acc_tail"] is not None)
        print(f"  {name} seed {seed} {tag or method:<11} acc last-{tail} {row['model.acc_tail']:.4f} (final "
              f"{row['model.acc_mean']:.4f}, pooled {row['model.acc_tail_pooled']:.4f}){extra}  "
              f"MB {row['mb_total']:.3f}  {row['wall_s']:.0f}s", flush=True)
    result = {"row": row, "bytes": None, "checks": {}}
    if method in UPLOAD_PREFIX and hist:  # the rounds it completed (a diverged run's too)
        per_client = [expected_upload(method, h, dim) for h in held]
        formula = sum(f for f, _ in per_client)
        header = sum(h for _, h in per_client)
        measured = [r["bytes_up"] for r in hist]
        result["checks"][f"{method} upload bytes = formula + header (every round)"] = \
            all(b == formula + header for b in measured)
        result["bytes"] = {"method": method, "formula_bytes_per_round": formula, "header_bytes_per_round": header,
                           "measured_bytes_per_round": sorted(set(measured)), "overhead_pct": 100.0 * header / formula}
    return result


def _cache_key(name: str, method: str, sets: list[str], hparams: dict, dim: int, tail: int) -> dict:
    """Everything a method's result depends on that the bench sets: every ``--set`` of the run (the
    common settings and the scenario's; rounds, seed, device among them), the method's resolved
    hyperparameters (so a changed default misses too), the model group, D, the tail length and the
    method's :data:`METHOD_VERSION` (code changes: bump it)."""
    return {"scenario": name, "method": method, "sets": list(sets), "hparams": json.loads(json.dumps(hparams, default=str)),
            "models": MODELS, "dim": dim, "tail": tail, "version": METHOD_VERSION.get(method, 1)}


def cached_method(name: str, method: str, sets: list[str], cfg, hparams: dict, held: list[list[int]], out: Path,
                  dim: int, seed: int, tail: int, tag: str | None = None) -> dict:
    """:func:`run_method`'s result, reused from ``OUT/<scenario>/seed<s>/<tag or method>.json`` when
    it was written with the same settings (:func:`_cache_key` of ``sets`` and ``hparams``), else
    run and written there."""
    key = _cache_key(name, method, sets, hparams, dim, tail)
    path = out / name / f"seed{seed}" / f"{tag or method}.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if cached.get("key") == key:
        print(f"  {name} seed {seed} {tag or method}: reusing {path}", flush=True)
        return cached["result"]
    res = run_method(name, method, cfg, hparams, held, out, dim, seed, tail, tag)
    atomic_write_json(path, {"key": key, "result": res})
    return res


def client_classes(cfg, dim: int) -> list[list[int]]:
    """The classes each client holds in its training split, for the upload-bytes formulas."""
    ds, part = load_data_and_partition(cfg)
    labels = ds.labels.numpy()
    return [sorted(set(labels[c.train].tolist())) for c in part.clients]


def run_seed(name: str, overrides: list[str], out: Path, rounds: int, dim: int, seed: int, tail: int,
             device: str = "cpu") -> dict:
    """Every method of :data:`METHODS` on one partition/seed, one run per method so progress prints.
    A method's result is reused from ``OUT/<scenario>/seed<s>/<method>.json`` when it was written
    with the same settings (:func:`_cache_key`): seeds can be added, one changed method re-measured
    alone, and an interrupted bench continues with the first method that has no result (a method
    interrupted mid-run starts again). Runs are deterministic for a seed on one thread."""
    sets = _method_sets(overrides, rounds, seed, device)
    cfg, hps = load_compare_config(None, sets, METHODS)
    held = client_classes(cfg, dim)
    per_method, bytes_rows, checks = {}, [], {}
    for m in METHODS:
        res = cached_method(name, m, sets, cfg, hps[m], held, out, dim, seed, tail)
        per_method[m] = res["row"]
        checks |= res["checks"]
        if res["bytes"]:
            bytes_rows.append(res["bytes"])
    return {"seed": seed, "methods": per_method, "bytes": bytes_rows, "checks": checks,
            "n_clients": len(held), "classes_held": [len(h) for h in held]}


def map_seeds(fn, work: list[tuple], jobs: int) -> list:
    """``[fn(w) for w in work]``, ``jobs`` at a time in spawned processes (one per seed) when
    ``jobs > 1``; ``fn`` takes the argument tuple and sets torch to one thread."""
    if jobs > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(work))) as pool:
            return pool.map(fn, work, chunksize=1)
    return [fn(w) for w in work]


def write_results(stem: str, only: list[str], args, text: str, results: list[dict], variant: str = "") -> None:
    """``bench/results/<stem>[_<only>][<variant>][_rounds<R>][_limit<N>][_dirmin<M>].md`` (``text``) and
    ``.json`` (the arguments and ``results``); the bracketed parts appear where the run differs from the
    defaults, so a longer run does not overwrite the committed 30-round report."""
    suffix = ("_" + "_".join(only) if only else "") + variant + (
        f"_rounds{args.rounds}" if args.rounds != 30 else "") + (
        f"_limit{args.limit_per_class}" if args.limit_per_class != 250 else "") + (
        f"_dirmin{args.dir_min_samples}" if args.dir_min_samples != DIRICHLET_MIN_SAMPLES else "")
    dest = ROOT / "bench" / "results"
    atomic_write_text(dest / f"{stem}{suffix}.md", text)
    atomic_write_json(dest / f"{stem}{suffix}.json",
                      {"args": vars(args) | {"out": str(args.out), "cifar": str(args.cifar)}, "results": results})


def _run_seed_star(args: tuple) -> dict:
    torch.set_num_threads(1)
    return run_seed(*args)


PAIRS = [("FedGH - Standalone", ("fedgh", "model.acc_tail"), ("standalone", "model.acc_tail")),
         ("FedGH +prior - Standalone", ("fedgh", "prior.acc_tail"), ("standalone", "model.acc_tail")),
         ("FedGH local header - Standalone", ("fedgh", "local.acc_tail"), ("standalone", "model.acc_tail")),
         ("FedTGP - Standalone", ("fedtgp", "model.acc_tail"), ("standalone", "model.acc_tail")),
         ("FedTGP - FedProto (head)", ("fedtgp", "model.acc_tail"), ("fedproto", "model.acc_tail")),
         ("FedTGP - FedProto (nearest prototype)", ("fedtgp", "proto.acc_tail"), ("fedproto", "proto.acc_tail"))]
# the accuracy claims (label, (method, rule), (method, rule), ">=" instead of ">"), checked on the
# mean over clients and on the pooled accuracy
CLAIMS = [("FedGH > Standalone", ("fedgh", "model"), ("standalone", "model"), False),
          ("FedTGP > Standalone", ("fedtgp", "model"), ("standalone", "model"), False),
          ("FedTGP >= FedProto (head)", ("fedtgp", "model"), ("fedproto", "model"), True),
          ("FedTGP >= FedProto (nearest prototype, the papers' protocol)", ("fedtgp", "proto"), ("fedproto", "proto"),
           True),
          ("FedGH + local label prior (label_prior: local; not in the paper) > Standalone", ("fedgh", "prior"),
           ("standalone", "model"), False),
          ("FedGH, local header (deploy_header: local; not in the paper) > Standalone", ("fedgh", "local"),
           ("standalone", "model"), False)]
# the same on the pooled accuracy (all test samples of all clients; runs cached before it was recorded
# have none, and their rows are left out)
PAIRS += [(f"{label}, pooled", (ma, ka + "_pooled"), (mb, kb + "_pooled")) for label, (ma, ka), (mb, kb) in PAIRS]


def completed_pairs(runs: list[dict], a: tuple[str, str], b: tuple[str, str]) -> tuple[list[tuple], list[str]] | None:
    """``([(seed, value a, value b)], notes)`` over the seeds on which neither method diverged
    (``notes`` name the seeds left out: "fedproto diverged on seed 0"; no rows when one diverged
    on every seed), or None when a completed run lacks a value (a rule the method does not have,
    or a metric cached runs predate): a comparison is made on every completed seed or not at all."""
    rows, notes = [], []
    for r in runs:
        (ma, ka), (mb, kb) = a, b
        div = [m for m in dict.fromkeys((ma, mb)) if "diverged" in r["methods"][m]]
        if div:
            notes.append(f"{', '.join(div)} diverged on seed {r['seed']}")
            continue
        va, vb = r["methods"][ma].get(ka), r["methods"][mb].get(kb)
        if va is None or vb is None:
            return None
        rows.append((r["seed"], va, vb))
    return rows, notes


def paired_differences(runs: list[dict]) -> list[dict]:
    """Per comparison of :data:`PAIRS`: the per-seed difference in points (both methods ran on the
    same partition, initialization and data order), its mean, its standard deviation over seeds,
    and on how many seeds it is positive (>= 0 for FedTGP - FedProto), over the seeds on which
    neither method diverged (:func:`completed_pairs`; the others are named in ``left_out``). The
    seed moves every method by several points (the partition changes), so the paired difference is
    the sharper measure."""
    out = []
    for label, a, b in PAIRS:
        pairs = completed_pairs(runs, a, b)
        if pairs is None or not pairs[0]:
            continue
        rows, notes = pairs
        diffs = [100 * (va - vb) for _, va, vb in rows]
        ok = [d >= 0 if "FedProto" in label else d > 0 for d in diffs]
        out.append({"comparison": label, "per_seed": diffs, "seeds": [sd for sd, _, _ in rows],
                    "mean": statistics.fmean(diffs), "sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                    "holds": sum(ok), "n": len(diffs), "left_out": notes})
    return out


def gap_by_window(runs: list[dict], window: int = WINDOW) -> dict[str, dict]:
    """Per method but Standalone: its deployed model's mean client accuracy minus Standalone's, in
    points, paired per round, averaged over each ``window`` rounds and then over the seeds where
    both completed (``{"gaps": [...], "n": seeds}``). The tail accuracy of the claims is one point
    of this curve; the windows show when a gain appears or fades (a method that converges slower
    than Standalone trails early and can lead later)."""
    out = {}
    for m in METHODS:
        if m == "standalone":
            continue
        per_seed = []
        for r in runs:
            a, b = r["methods"][m], r["methods"]["standalone"]
            ca, cb = a.get("curve"), b.get("curve")
            if "diverged" in a or "diverged" in b or not ca or len(ca) != len(cb or []):
                continue
            diffs = [100 * (x - y) for x, y in zip(ca, cb)]
            per_seed.append([statistics.fmean(diffs[i:i + window]) for i in range(0, len(diffs), window)])
        if per_seed:
            out[m] = {"gaps": [statistics.fmean(col) for col in zip(*per_seed)], "n": len(per_seed)}
    return out


def scenario(name: str, overrides: list[str], out: Path, rounds: int, dim: int, seeds: list[int], tail: int,
             device: str = "cpu", jobs: int = 1) -> dict:
    """All seeds of one scenario (``jobs`` seeds at a time, each in its own process), the accuracy
    claims on the mean over seeds, the byte checks per seed."""
    t0 = time.perf_counter()
    runs = map_seeds(_run_seed_star, [(name, overrides, out, rounds, dim, s, tail, device) for s in seeds], jobs)
    return summarize(name, runs) | {"elapsed_s": time.perf_counter() - t0}


def summarize(name: str, runs: list[dict]) -> dict:
    """:func:`scenario`'s result from the per-seed results of :func:`run_seed`: per method the
    means over seeds (diverged runs left out and listed), the claims of :data:`CLAIMS` (``checks``;
    a claim whose methods never both completed a seed is listed in ``unmeasured``), the byte
    checks per seed, the paired differences."""

    def stat(method: str, key: str) -> tuple[float | None, float | None, list[float]]:
        vals = [r["methods"][method][key] for r in runs if r["methods"][method].get(key) is not None]
        if not vals:
            return None, None, []
        return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), vals

    def first(method: str, key: str):
        return next((r["methods"][method][key] for r in runs if r["methods"][method].get(key) is not None), None)

    summary = {}
    for m in METHODS:
        mean, sd, vals = stat(m, "model.acc_tail")
        pmean, psd, pvals = stat(m, "proto.acc_tail")
        qmean, _, qvals = stat(m, "prior.acc_tail")
        lmean, _, lvals = stat(m, "local.acc_tail")
        pooled = {rule: stat(m, f"{rule}.acc_tail_pooled") for rule in RULES}
        # a pooled mean only when every completed seed has it (runs cached before it was recorded have none)
        done = sum("diverged" not in r["methods"][m] for r in runs)
        pooled = {rule: (v[0] if done and len(v[2]) == done else None) for rule, v in pooled.items()}
        summary[m] = {"acc": mean, "acc_sd_seeds": sd, "acc_per_seed": vals, "proto": pmean, "proto_sd_seeds": psd,
                      "proto_per_seed": pvals, "prior": qmean, "prior_per_seed": qvals,
                      "local": lmean, "local_per_seed": lvals, "pooled": pooled,
                      "client_std": (statistics.fmean(v for r in runs if (v := r["methods"][m]["model.acc_std"])
                                                      is not None) if vals else None),
                      "mb_up": first(m, "mb_up"), "mb_total": first(m, "mb_total"),
                      "wall_s": statistics.fmean(r["methods"][m]["wall_s"] for r in runs),
                      # (seed, round, error) of every seed on which the method diverged
                      "diverged": [(r["seed"], r["methods"][m]["diverged_round"], r["methods"][m]["diverged"])
                                   for r in runs if "diverged" in r["methods"][m]]}
    # each claim on the mean over seeds of each side, over the seeds on which neither method
    # diverged (the label then says which were left out); per metric: the mean over clients and
    # the pooled accuracy (skipped where cached runs predate it)
    checks, unmeasured = {}, []
    for suffix, key in (("", "acc_tail"), (", pooled", "acc_tail_pooled")):
        for label, (ma, ra), (mb, rb), at_least in CLAIMS:
            pairs = completed_pairs(runs, (ma, f"{ra}.{key}"), (mb, f"{rb}.{key}"))
            if pairs is None:
                continue
            rows, notes = pairs
            if not rows:
                unmeasured.append(f"{label}{suffix} ({'; '.join(notes)})")
                continue
            a, b = statistics.fmean(v for _, v, _ in rows), statistics.fmean(v for _, _, v in rows)
            checks[label + suffix + (f" (without seeds where {'; '.join(notes)})" if notes else "")] = \
                a >= b if at_least else a > b
    for r in runs:
        for k, v in r["checks"].items():
            checks[f"{k}, seed {r['seed']}"] = v
    # the compute the scenario took: every method run of every seed (also when seeds were reused from
    # the cache or ran in parallel; this call itself took elapsed_s)
    return {"scenario": name, "summary": summary, "checks": checks, "unmeasured": unmeasured,
            "paired": paired_differences(runs), "by_window": gap_by_window(runs), "runs": runs,
            "wall_s": sum(r["methods"][m]["wall_s"] for r in runs for m in METHODS),
            "n_clients": runs[0]["n_clients"], "classes_held": runs[0]["classes_held"]}


def report(results: list[dict], args, argv: list[str]) -> str:
    seeds = ", ".join(map(str, args.seeds))
    lines = ["# HtFL bench (`python bench/htfl_bench.py " + " ".join(argv) + "`)", "",
             f"Models: htfe-tiny round-robin (cnn4-small, cnn3-small, mobilenet_v2-0.25, shufflenet_v2-0.5), "
             f"D = {args.feature_dim}; {args.rounds} rounds on {args.device}, 1 local epoch (SGD lr 0.01, momentum 0.9, "
             "batch 10), every method at its defaults; each client's data split 75% train / 25% test (20% / 80% "
             "in digits-pat2-train20); all 20 "
             f"clients every round. CIFAR-10 subset: {args.limit_per_class} images per class from each of the shared "
             "train and test sets (data.limit_per_class), pooled, then partitioned. Seeds "
             f"{seeds} (the seed sets the partition, the models' init and the data order).", "",
             f"**acc** = mean over clients of the deployed model's test accuracy, averaged over the last {args.tail} "
             "rounds (one round's value moves by 1-3 points: ~60 test images per client), then over seeds; "
             "**proto** = the same for nearest-global-prototype inference (FedProto / FedTGP; the accuracy "
             "both papers and HtFLlib report); **+prior** = FedGH's global header plus each client's log label "
             "prior (`label_prior: local`, not in the paper; same training run); **local** = FedGH's client model as "
             "it leaves local training, its header fine-tuned from the global one (`deploy_header: local`, not in "
             "the paper; same training run). Claims compare these means. **pooled** = the same rules on all "
             "clients' test samples together (correct / samples, then averaged like acc): the \"Averaged Test "
             "Accuracy\" HtFLlib and PFLlib report, where a client counts by its test samples; `-` where the "
             "cached runs predate it.", ""]
    for res in results:
        lines += [f"## {res['scenario']} ({res['n_clients']} clients, classes held per client (seed "
                  f"{args.seeds[0]}): min {min(res['classes_held'])}, max {max(res['classes_held'])}; "
                  f"{res['wall_s']:.0f} s of method runs)", "",
                  "| method | acc | per seed | vs standalone (points) | proto acc | per seed | +prior acc | per seed | "
                  "local acc | per seed | pooled, per rule | client std | MB up | MB total | "
                  "wall s / seed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:.4f}"

        for m, s in res["summary"].items():
            # per seed in seed order, "diverged (round N)" where it did
            per = ", ".join(f"diverged (round {r['methods'][m]['diverged_round']})" if "diverged" in r["methods"][m]
                            else fmt(r["methods"][m]["model.acc_tail"]) for r in res["runs"])
            acc = fmt(s["acc"])
            # vs Standalone on the seeds where both completed (paired: a mean over other seeds than
            # Standalone's would mix partitions)
            pairs = completed_pairs(res["runs"], (m, "model.acc_tail"), ("standalone", "model.acc_tail"))
            gain = "-" if not pairs or not pairs[0] else f"{100 * statistics.fmean(a - b for _, a, b in pairs[0]):+.2f}"
            if s["diverged"]:
                done = [sd for sd, _, _ in pairs[0]] if pairs else []
                acc += f" (seed{'s' if len(done) != 1 else ''} {', '.join(map(str, done)) or 'none'})"
                gain += f" (seed{'s' if len(done) != 1 else ''} {', '.join(map(str, done)) or 'none'})"
            proto = f"{s['proto']:.4f}" if s["proto"] is not None else "-"
            pper = ", ".join(f"{v:.4f}" for v in s["proto_per_seed"]) or "-"
            prior = f"{s['prior']:.4f}" if s["prior"] is not None else "-"
            qper = ", ".join(f"{v:.4f}" for v in s["prior_per_seed"]) or "-"
            local = f"{s['local']:.4f}" if s["local"] is not None else "-"
            lper = ", ".join(f"{v:.4f}" for v in s["local_per_seed"]) or "-"
            pooled = ", ".join(f"{r} {v:.4f}" for r, v in s["pooled"].items() if v is not None) or "-"
            lines.append(f"| {m} | {acc} | {per} | {gain} | {proto} | {pper} | "
                         f"{prior} | {qper} | {local} | {lper} | {pooled} | "
                         f"{fmt(s['client_std'])} | {fmt(s['mb_up'])} | {fmt(s['mb_total'])} | {s['wall_s']:.0f} |")
        diverged = [(m, d) for m, s in res["summary"].items() for d in s["diverged"]]
        if diverged:
            lines += ["", "Diverged runs (left out of every mean, and out of each comparison on that seed):", ""]
            lines += [f"- {m}, seed {seed}, round {rnd}: {msg}" for m, (seed, rnd, msg) in diverged]
        lines += ["", "| upload per round (seed " + str(res["runs"][0]["seed"]) + ") | formula bytes | "
                  "+ safetensors header | = expected | measured | header overhead |", "|---|---|---|---|---|---|"]
        for b in res["runs"][0]["bytes"]:
            lines.append(f"| {b['method']} | {b['formula_bytes_per_round']} | {b['header_bytes_per_round']} | "
                         f"{b['formula_bytes_per_round'] + b['header_bytes_per_round']} | "
                         f"{', '.join(map(str, b['measured_bytes_per_round']))} | {b['overhead_pct']:.1f}% |")
        if res.get("paired"):
            lines += ["", "| paired difference (points) | per seed | mean | sd over seeds | holds on |",
                      "|---|---|---|---|---|"]
            for d in res["paired"]:
                per = ", ".join(f"{v:+.2f}" for v in d["per_seed"])
                if d.get("left_out"):
                    per = ", ".join(f"seed {sd} {v:+.2f}" for sd, v in zip(d["seeds"], d["per_seed"])) + \
                        f" ({'; '.join(d['left_out'])})"
                lines.append(f"| {d['comparison']} | {per} | "
                             f"{d['mean']:+.2f} | {d['sd']:.2f} | {d['holds']}/{d['n']} seeds |")
        if res.get("by_window"):
            n_rounds = max(len(r["methods"]["standalone"].get("curve") or []) for r in res["runs"])
            heads = [f"{i + 1}-{min(i + WINDOW, n_rounds)}" for i in range(0, n_rounds, WINDOW)]
            lines += ["", f"Deployed model's mean client accuracy minus Standalone's (points), per {WINDOW}-round "
                      "window, paired per round, mean over seeds:", "",
                      "| method | seeds | " + " | ".join(f"rounds {h}" for h in heads) + " |",
                      "|---|---|" + "---|" * len(heads)]
            for m, w in res["by_window"].items():
                lines.append(f"| {m} | {w['n']} | " + " | ".join(f"{g:+.2f}" for g in w["gaps"]) + " |")
        lines += [""] + [f"- {'PASS' if v else 'FAIL'}: {k}" for k, v in res["checks"].items()]
        lines += [f"- NOT MEASURED: {k}" for k in res.get("unmeasured", [])] + [""]
    return "\n".join(lines) + "\n"


def scenario_overrides(args) -> dict[str, list[str]]:
    """Scenario name -> its config overrides (``--set`` strings)."""
    common = ["clients.n=20"]
    return {
        "digits-pat2": common + ["data.dataset=digits", "partition.scheme=pathological", "partition.k=2"],
        # the same with 20% of each client's samples for training (~13 images, 6-7 per class; 80% for
        # test): Standalone is saturated at ~0.98 on the 75% split, this leaves room to measure
        "digits-pat2-train20": common + ["data.dataset=digits", "partition.scheme=pathological", "partition.k=2",
                                         "partition.split=[0.2,0.0,0.8]"],
        "cifar10-pat2": common + ["data.dataset=cifar10", f"data.root={args.cifar}",
                                  f"data.limit_per_class={args.limit_per_class}", "partition.scheme=pathological",
                                  "partition.k=2"],
        # every client holds >= 40 samples by default, HtFLlib's rule (least_samples = batch_size / test
        # share = 10 / 0.25: >= 10 test samples per client); with rafl's default 10 a client may test on
        # as few as 2 images and alone move the mean over clients by 2.5 points per image. With
        # --limit-per-class 100 (~100 samples per client) few Dirichlet draws reach 40: use 10 there
        "cifar10-dir0.1": common + ["data.dataset=cifar10", f"data.root={args.cifar}",
                                    f"data.limit_per_class={args.limit_per_class}", "partition.scheme=dirichlet",
                                    "partition.alpha=0.1", f"partition.min_samples={args.dir_min_samples}"],
    }


def selected(ap: argparse.ArgumentParser, args) -> tuple[dict[str, list[str]], list[str]]:
    """The scenarios ``--only`` names (all when empty) and the names; an unknown name is a usage
    error (exit 2) before anything runs or is written."""
    scenarios = scenario_overrides(args)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in scenarios]
    if unknown:
        ap.error(f"--only: unknown scenario {', '.join(unknown)}; allowed: {', '.join(scenarios)}")
    return {n: sets for n, sets in scenarios.items() if not only or n in only}, only


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options this bench shares with ``bench/fedgh_sweep.py``."""
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    ap.add_argument("--tail", type=int, default=5, help="accuracy = mean over the last TAIL rounds")
    ap.add_argument("--limit-per-class", type=int, default=250)
    ap.add_argument("--dir-min-samples", type=int, default=DIRICHLET_MIN_SAMPLES,
                    help="the Dirichlet scenario's smallest client (partition.min_samples; HtFLlib's rule: 40)")
    ap.add_argument("--feature-dim", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("/tmp") / f"htfl-bench-{int(time.time())}",
                    help="cache and run dirs (shared with the other bench: Standalone runs once)")
    ap.add_argument("--only", default="", help="comma list of scenario names to run")
    ap.add_argument("--cifar", type=Path, default=CIFAR, help="the CIFAR-10 archive (default ../shared/data)")
    ap.add_argument("--device", default="cpu", help="torch device for local and server training")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run in parallel (one process and core each)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    scenarios, only = selected(ap, args)
    results = []
    for name, sets in scenarios.items():
        print(f"== {name}", flush=True)
        res = scenario(name, sets, args.out, args.rounds, args.feature_dim, args.seeds, args.tail, args.device,
                       args.jobs)
        results.append(res)
        for k, v in res["checks"].items():
            print(f"  {'PASS' if v else 'FAIL'} {k}", flush=True)
        for k in res["unmeasured"]:
            print(f"  NOT MEASURED {k}", flush=True)
    text = report(results, args, argv)
    print(text)
    write_results("htfl_bench", only, args, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
