"""RaFL bench: accuracy vs Standalone, upload bytes vs FedAvg, engine overhead.

Scenarios (every method on the same clients, partition, subnets and seed, in this process):

* **digits default pipeline** -- exactly what ``rafl federate`` runs with no arguments (10 clients,
  profiles pi4 / jetson-nano / phone, Dirichlet alpha 0.5, the quickstart supernet, one searched
  subnet per profile), RaFL and Standalone for ``--rounds`` rounds.
* **CIFAR-10 subset** -- the shared JPEG set with ``--cifar-limit`` images per class and source
  split (default 100: 2,000 images), the public pool carved with ``carve_public_pool(labels, 0.3,
  seed=0)``; the supernet is a width-0.35 OFA MobileNet-V3 supernet *trained briefly on that
  public pool only* (``--cifar-supernet-epochs``); ``--cifar-clients`` clients (default 10,
  Dirichlet 0.5); subnets per profile by the ``largest-feasible`` rule (cost model, no accuracy
  search, to keep the bench inside its CPU budget); RaFL and Standalone.

The knowledge network is RaFL's default: the smallest subnet narrowed to ``knowledge_width=0.375``
(:func:`rafl.supernet.model.narrow_width`).

Accuracy = mean client test accuracy averaged over the last ``--tail`` rounds, then over
``--seeds`` (the seed sets the partition, the models' init and the data order). The CIFAR-10
clients hold ~14 test images each (~140 in all): one run's final round moves by several points,
so a single seed's final value is not a measurement.

Claims (printed PASS/FAIL; numbers always written):

1. RaFL's specialized models beat Standalone by >= 5 points of mean client test accuracy.
2. Upload bytes per client per round, RaFL (knowledge network) vs FedAvg with the same local
   models (each client uploading its specialized subnet; FedAvg run for real, one round, on a
   homogeneous population per distinct subnet, bytes from the engine): ratio <= 1/4.
3. Engine overhead (round time outside client_update, server_aggregate and evaluation: state
   I/O, payload serialization/validation, sampling, metrics, checkpoints) <= 5% of the round.

Digits caveat: Standalone starts from the supernet's weights and reaches >= 0.96 on the clients'
own test splits, so claim 1 cannot hold there (it would need > 100%); the table prints that
ceiling and the relative error reduction next to the gain.

Run: ``python bench/federate_rafl.py [--rounds 10] [--seeds 0,1,2] [--tail 3] [--cifar-limit 100]
[--skip-cifar]``; writes ``bench/results/federate_rafl.md`` and ``.json`` (about 20 minutes on one
core).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rafl.federation.run_config import load_run_config
from rafl.io import atomic_write_json, atomic_write_text
from rafl.stages import federate

ROOT = Path(__file__).resolve().parents[1]
CIFAR = ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"


def _tail(hist: list[dict], key: str, tail: int) -> float | None:
    vals = [h[key] for h in hist if key in h][-tail:]
    return sum(vals) / len(vals) if vals else None


def run_algo(prep, name: str, workdir: Path, tail: int) -> dict:
    t0 = time.perf_counter()
    summary = federate.run(prep, workdir / name, progress=False)
    hist = [json.loads(ln) for ln in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    tot = sum(r["time_s"] for r in hist)
    eng = sum(r["time_engine_s"] for r in hist)
    ev = sum(r["time_evaluate_s"] for r in hist)
    return {"summary": summary, "wall_s": time.perf_counter() - t0,
            "engine_share_of_round": eng / tot, "engine_share_excl_eval": eng / max(1e-9, tot - ev),
            "bytes_up_per_client_per_round": summary["mean_bytes_up_per_client_per_round"],
            "acc_model": summary["final"].get("model.acc_mean_over_clients"),
            "acc_model_weighted": summary["final"].get("model.acc_sample_weighted"),
            "acc_knowledge": summary["final"].get("knowledge.acc_mean_over_clients"),
            "acc_tail": _tail(hist, "model.acc_mean_over_clients", tail),
            "knowledge_tail": _tail(hist, "knowledge.acc_mean_over_clients", tail),
            "curve": [round(h["model.acc_mean_over_clients"], 4) for h in hist if "model.acc_mean_over_clients" in h]}


def fedavg_bytes(overrides: list[str], archs: dict[str, int], workdir: Path) -> tuple[float, dict[str, float]]:
    """Client-weighted mean FedAvg upload bytes per client per round over the distinct subnets,
    and the bytes per subnet."""
    total, n, per = 0.0, 0, {}
    for i, (arch, count) in enumerate(sorted(archs.items())):
        cfg = load_run_config(None, [*overrides, "algorithm.name=fedavg", f"clients.arch={arch}",
                                     "engine.rounds=1", "engine.clients_per_round=2", "engine.eval_clients=sampled"])
        prep = federate.prepare(cfg, progress=False)
        s = federate.run(prep, workdir / f"fedavg{i}", progress=False)
        per[arch] = s["mean_bytes_up_per_client_per_round"]
        total += per[arch] * count
        n += count
    return total / n, per


def scenario(label: str, overrides: list[str], workdir: Path, seeds: list[int], tail: int) -> dict:
    """RaFL and Standalone for every seed (same partition, subnets and init per seed); the
    accuracies as the mean over seeds of each run's last-``tail``-round mean."""
    out: dict = {"label": label, "overrides": overrides, "per_seed": []}
    for seed in seeds:
        sets = [*overrides, f"seed={seed}"]
        prep = federate.prepare(load_run_config(None, sets), progress=seed == seeds[0])
        if seed == seeds[0]:
            out["clients"] = prep.clients_table
        rafl = run_algo(prep, "rafl", workdir / f"seed{seed}", tail)
        prep_sa = federate.prepare(load_run_config(None, [*sets, "algorithm.name=standalone"]), progress=False)
        sa = run_algo(prep_sa, "standalone", workdir / f"seed{seed}", tail)
        for r in (rafl, sa):
            r.pop("summary")
        out["per_seed"].append({"seed": seed, "rafl": rafl, "standalone": sa})
        print(f"  {label} seed {seed}: RaFL {rafl['acc_tail']:.4f} (knowledge {rafl['knowledge_tail']:.4f}), "
              f"Standalone {sa['acc_tail']:.4f}, gain {100 * (rafl['acc_tail'] - sa['acc_tail']):+.2f}", flush=True)
    runs = out["per_seed"]

    def mean(algo: str, key: str) -> float:
        return statistics.fmean(r[algo][key] for r in runs)

    out["rafl"] = {"acc_model": mean("rafl", "acc_tail"), "acc_knowledge": mean("rafl", "knowledge_tail"),
                   "bytes_up_per_client_per_round": runs[0]["rafl"]["bytes_up_per_client_per_round"],
                   "engine_share_of_round": mean("rafl", "engine_share_of_round"),
                   "engine_share_excl_eval": mean("rafl", "engine_share_excl_eval")}
    out["standalone"] = {"acc_model": mean("standalone", "acc_tail")}
    out["gain_per_seed_points"] = [100 * (r["rafl"]["acc_tail"] - r["standalone"]["acc_tail"]) for r in runs]
    counts: dict[str, int] = {}
    for row in out["clients"]:
        counts[row["arch"]] = counts.get(row["arch"], 0) + 1
    out["fedavg_bytes_up_per_client_per_round"], out["fedavg_bytes_per_arch"] = fedavg_bytes(
        [*overrides, f"seed={seeds[0]}"], counts, workdir)
    return out


def cifar_supernet(limit: int, epochs: int, workdir: Path) -> Path:
    """A width-0.35 supernet trained on the CIFAR-10 subset's public pool only (progressive
    shrinking with few epochs), saved for ``supernet.path``."""
    from rafl.supernet import TrainConfig, train_supernet

    cfg = TrainConfig(dataset="cifar10", data_root=str(CIFAR), limit_per_class=limit, public_fraction=0.3,
                      public_seed=0, width_mult=0.35, resolutions=(24,), epochs_full=epochs, epochs_kernel=1,
                      epochs_depth=1, epochs_expand=1, test_samples=500)
    d = workdir / "cifar-supernet"
    train_supernet(cfg, d, progress=True)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 2])
    ap.add_argument("--tail", type=int, default=3, help="accuracy = mean over the last TAIL rounds")
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--cifar-limit", type=int, default=100, help="CIFAR-10 images per class and source split")
    ap.add_argument("--cifar-supernet-epochs", type=int, default=6)
    ap.add_argument("--cifar-clients", type=int, default=10)
    ap.add_argument("--skip-cifar", action="store_true")
    ap.add_argument("--skip-digits", action="store_true")
    ap.add_argument("--digits-supernet", default=None, help="a digits supernet dir (default: the quickstart)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results = {"argv": sys.argv, "torch": torch.__version__, "machine": platform.machine(), "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = [f"engine.rounds={args.rounds}", f"algorithm.local_epochs={args.local_epochs}",
                "engine.target_accuracy=0.9"]
        if not args.skip_digits:
            dig = base + ([f"supernet.path={args.digits_supernet}"] if args.digits_supernet else [])
            results["digits"] = scenario("digits default pipeline", dig, work / "digits", args.seeds, args.tail)
        if not args.skip_cifar:
            sdir = cifar_supernet(args.cifar_limit, args.cifar_supernet_epochs, work)
            cif = [*base, "data.dataset=cifar10", f"data.root={CIFAR}", f"data.limit_per_class={args.cifar_limit}",
                   f"supernet.path={sdir}", f"clients.n={args.cifar_clients}", "search.method=largest-feasible",
                   "partition.min_samples=5"]
            results["cifar10"] = scenario(f"CIFAR-10 subset ({args.cifar_limit}/class)", cif, work / "cifar",
                                          args.seeds, args.tail)
    results["wall_s"] = time.perf_counter() - t0

    lines = [f"# bench/federate_rafl.py  {' '.join(sys.argv[1:])}  torch {torch.__version__}  threads={args.threads}", "",
             f"Accuracy: mean client test accuracy over the last {args.tail} of {args.rounds} rounds, then the mean "
             f"over seeds {', '.join(map(str, args.seeds))}; local training ends with BN recalibration of the "
             "specialized (and Standalone's) model.", ""]
    lines.append("| scenario | RaFL specialized acc | RaFL knowledge acc | Standalone acc | gain (points) | gain per seed | "
                 "RaFL up B/client/round | FedAvg up B/client/round | ratio | engine overhead (of round / excl. eval) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for key in ("digits", "cifar10"):
        if key not in results:
            continue
        r = results[key]
        gain = 100 * (r["rafl"]["acc_model"] - r["standalone"]["acc_model"])
        ratio = r["rafl"]["bytes_up_per_client_per_round"] / r["fedavg_bytes_up_per_client_per_round"]
        eng = r["rafl"]["engine_share_of_round"]
        r.update({"gain_points": gain, "upload_ratio_vs_fedavg": ratio})
        lines.append(f"| {r['label']} | {r['rafl']['acc_model']:.4f} | {r['rafl']['acc_knowledge']:.4f} | "
                     f"{r['standalone']['acc_model']:.4f} | {gain:+.2f} | "
                     f"{', '.join(f'{g:+.2f}' for g in r['gain_per_seed_points'])} | {r['rafl']['bytes_up_per_client_per_round']:.0f} | "
                     f"{r['fedavg_bytes_up_per_client_per_round']:.0f} | {ratio:.3f} | {100 * eng:.2f}% / "
                     f"{100 * r['rafl']['engine_share_excl_eval']:.2f}% |")
        ceiling = 100 * (1 - r["standalone"]["acc_model"])
        err_red = 100 * (r["rafl"]["acc_model"] - r["standalone"]["acc_model"]) / max(1e-9, 1 - r["standalone"]["acc_model"])
        r.update({"max_possible_gain_points": ceiling, "error_reduction_pct": err_red})
        verdicts += [f"{key}: RaFL vs Standalone >= +5 points: {'PASS' if gain >= 5 else 'FAIL'} ({gain:+.2f}; "
                     f"at most {ceiling:+.2f} possible; error reduced by {err_red:.0f}%)",
                     f"{key}: upload RaFL / FedAvg <= 1/4: {'PASS' if ratio <= 0.25 else 'FAIL'} ({ratio:.3f})",
                     f"{key}: engine overhead <= 5% of the round: {'PASS' if eng <= 0.05 else 'FAIL'} ({100 * eng:.2f}%)"]
    lines += ["", *verdicts]
    for key in ("digits", "cifar10"):
        if key not in results:
            continue
        lines += ["", f"Per-client subnets ({key}):", ""]
        for row in results[key]["clients"]:
            ratio = results[key]["rafl"]["bytes_up_per_client_per_round"] / results[key]["fedavg_bytes_per_arch"][row["arch"]]
            lines.append(f"- client {row['client']} {row['profile']}: {row['macs_m']:.2f} M MACs, {row['params_m']:.3f} M "
                         f"params, {row['n_train']} train samples, upload ratio {ratio:.3f}, {row['arch']}")
    lines += ["", f"wall {results['wall_s']:.1f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results"
    atomic_write_text(out / "federate_rafl.md", text)
    atomic_write_json(out / "federate_rafl.json", results)


if __name__ == "__main__":
    main()
