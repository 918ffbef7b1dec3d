"""HtFLlib side by side: rafl's FedProto (and FedGH, FedTGP, Standalone) against HtFLlib's own
code (TsingZ0/HtFLlib, the FedTGP paper's library) on the same data, partition, model and
hyperparameters, each in its own process with one torch thread; time, peak RSS and accuracy.

HtFLlib is not a pip package and nothing downloads at run time: ``--htfllib PATH`` names a checkout
(``git clone https://github.com/TsingZ0/HtFLlib``; its ``system/`` is imported as it is, never edited
or copied into rafl). Without one the bench exits 2 with one line. HtFLlib's modules import
``h5py`` and ``scikit-learn`` (``pip install h5py scikit-learn``, or ``--htfllib-pythonpath DIR``
holding them, added to the HtFLlib process's ``PYTHONPATH`` only).

Scenario: ``bench/round_speed.py``'s cnn4 scenario, its own data and partition code
(:func:`round_speed.overrides`, :func:`round_speed.write_data`): a CIFAR-10 subset
(``--limit-per-class`` images per class of each split, pooled), ``--clients`` clients with 2 classes
each (pathological), rafl's default split per client (train / val / test 0.8 / 0.1 / 0.1; the val
split is read by neither side; no public pool), batch 10, 1 local epoch, every client every round, every
client evaluated every round, ``--rounds`` rounds. The same partition is written in HtFLlib's format
(``dataset/<name>/train/<id>.npz`` and ``test/<id>.npz``: ``np.savez_compressed(f, data={"x":
float32 N x 3 x 32 x 32, "y": int64})``, as its ``dataset/generate_*.py`` write them) with rafl's
normalization already applied (HtFLlib stores normalized floats; rafl normalizes its uint8 pixels
per batch with the same mean and std), so both train and test on the same values.

Model: rafl's ``cnn4`` (``rafl.models.make_member``, D = 128) on both sides. HtFLlib builds models
with ``BaseHeadSplit``, which ``eval``s the strings of ``args.models`` in
``flcore.trainmodel.models``; the HtFLlib process puts :func:`rafl_member` into that module's
namespace (nothing in the checkout is changed) and sets ``args.models =
["rafl_member('cnn4', ...)"]``. ``BaseHeadSplit`` then does to it what it does to its own models:
the member's ``head`` becomes ``nn.AdaptiveAvgPool1d(D)`` (the identity on ``(B, D)``) inside
``model.base`` and a new ``Linear(D, K)`` is ``model.head`` -- the same parameters as rafl's.

Hyperparameters: HtFLlib's defaults (``main.py``'s parser: SGD lr 0.01, no momentum or weight
decay, FedProto/FedTGP lamda 1 with ``MSELoss``, server lr 0.01, ``server_epochs`` 100, FedTGP's
margin threshold 100 and server batch = the batch size), and rafl set to the same
(:data:`RAFL_SAME`: lr 0.01, momentum 0, weight decay 0; FedTGP's ``distance: mse``,
``lambda_mse: 1``, ``server_batch_size: 10``; FedGH's ``server_epochs: 100``, no gradient
clipping). rafl's FedProto runs at its default ``class_means: last_epoch`` (prototypes from the
training pass, as HtFLlib's ``clientProto.train`` collects them); FedTGP at its default
``eval_pass`` (HtFLlib's ``clientTGP.collect_protos``, an eval-mode pass after training).

HtFLlib's process (``--variant htfllib``) runs its ``main.py`` without its model-family chain:
the argument parser is ``main.py``'s own (read from the checkout with ``ast`` and executed), then
``torch.manual_seed(0)`` as ``main.py`` does, ``args.models`` as above, the method's server class
from ``flcore.servers`` and ``server.train()``. Its ``train()`` loop evaluates *before* training
in each of its ``global_rounds + 1`` iterations; the process runs with ``-gr R`` and is stopped
(an exception raised after its evaluation) at the evaluation that follows the R-th training, then
``save_results()`` runs as at the end of ``train()``: R trainings and R evaluations, as rafl's R
rounds, and its last evaluation is the accuracy reported.

What each time covers (``--mode pairs``: both processes started together, so they share the
machine's load; ``alternate``: one after the other, the order swapped each repeat):

* rafl: ``federate.run`` -- R rounds (training, server step, evaluation of every client) and
  everything the engine writes (state files, checkpoints, metrics files, the summary and the two
  plots at the end). Not the data loading, partition and model building (``federate.prepare``).
* HtFLlib: from the end of its round-0 evaluation (of the untrained models) to the end of
  ``save_results()`` -- R trainings, server steps and R evaluations. It includes what HtFLlib does
  in every round by design: each client re-reads its ``.npz`` files (train to train, test to
  evaluate; from the page cache) and ``torch.save`` / ``torch.load`` of every model, prototype set
  and server state through files. Not the server's construction (reading every client's data once,
  building and saving the models), reported apart as ``setup``.
* ``cpu s``: the process's CPU time (user + system, one thread) over the same span, less
  sensitive than wall time to the other jobs of a shared machine.
* ``process s``: the whole process, start to exit (imports, data loading, everything).
* peak RSS: of each process tree, sampled every 0.2 s from ``/proc`` (``round_speed._memory``), or the
  kernel's exact peak of the process (``ru_maxrss`` from ``wait4``; neither side starts a child) if larger.

Accuracy: the final round's, per client then averaged (``mean``), and pooled over all clients'
test images (``pooled``: HtFLlib's "Averaged Test Accuracy"; rafl's ``acc_sample_weighted``).
HtFLlib's FedProto and FedTGP report the nearest global prototype (their ``test_metrics``), rafl's
``proto``; FedGH and Local report the model's head, rafl's ``model``.

Run: ``nice -n 5 python bench/htfllib_side_by_side.py --htfllib /tmp/htfllib``; writes
``bench/results/htfllib_side_by_side.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import round_speed as rs

ROOT = Path(__file__).resolve().parents[1]
#: rafl's method -> HtFLlib's ``-algo``
HTFL_ALGO = {"fedproto": "FedProto", "fedgh": "FedGH", "fedtgp": "FedTGP", "standalone": "Local"}
#: HtFLlib's ``-algo`` -> (module, server class) under its ``system/``
HTFL_SERVER = {"FedProto": ("flcore.servers.serverproto", "FedProto"), "FedGH": ("flcore.servers.servergh", "FedGH"),
               "FedTGP": ("flcore.servers.servertgp", "FedTGP"), "Local": ("flcore.servers.serverlocal", "Local")}
#: rafl set to HtFLlib's defaults (main.py's parser and the methods' code), per method
RAFL_SAME = {
    "*": ["algorithm.lr=0.01", "algorithm.momentum=0.0", "algorithm.weight_decay=0.0"],
    "fedproto": ["algorithm.lambda=1.0", "algorithm.distance=mse"],
    "fedtgp": ["algorithm.distance=mse", "algorithm.lambda_mse=1.0", "algorithm.server_lr=0.01",
               "algorithm.server_epochs=100", "algorithm.server_batch_size=10", "algorithm.tau=100.0"],
    "fedgh": ["algorithm.server_lr=0.01", "algorithm.server_epochs=100", "algorithm.server_max_grad_norm=0.0"],
    "standalone": [],
}
#: which accuracy is compared with HtFLlib's (its test_metrics): nearest prototype or the head
RAFL_ACC = {"fedproto": "proto", "fedtgp": "proto", "fedgh": "model", "standalone": "model"}
DATASET = "Cifar10-rafl"


def rafl_overrides(args, method: str) -> list[str]:
    return [*rs.overrides(args, method, args.clients, args.limit_per_class, 1, args.rounds),
            *RAFL_SAME["*"], *RAFL_SAME[method.partition("@")[0]]]


# ---------------------------------------------------------------------- variants (child processes)
def run_rafl(args) -> dict:
    import torch

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    torch.set_num_threads(1)
    cfg = load_run_config(None, rafl_overrides(args, args.method))
    prep = federate.prepare(cfg, progress=False)
    prof = _profiler(args)
    with tempfile.TemporaryDirectory() as d:
        c0, t0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        summary = federate.run(prep, Path(d) / "run", progress=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        _dump(args, prof)
        hist = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    final = summary["final"]
    acc = {m: {"mean": final[f"{m}.acc_mean_over_clients"], "pooled": final[f"{m}.acc_sample_weighted"]}
           for m in ("model", "proto", "local") if f"{m}.acc_mean_over_clients" in final}
    return {"wall_s": wall, "cpu_s": cpu, "rounds_s": sum(r["time_s"] for r in hist),
            "client_update_s": sum(r["time_client_update_s"] for r in hist),
            "evaluate_s": sum(r["time_evaluate_s"] for r in hist), "acc": acc,
            "threads": torch.get_num_threads()}


def _profiler(args):
    """A cProfile.Profile when ``--profile DIR`` is given (the timed span only), else None. Its clock
    is the process's CPU time: on a shared machine wall-clock profiles mostly measure waiting."""
    if not args.profile:
        return None
    import cProfile

    return cProfile.Profile(time.process_time)


def _dump(args, prof) -> None:
    """Write ``prof``'s stats as ``DIR/<variant>-<method>.prof`` and a text summary beside it."""
    if prof is None:
        return
    import io
    import pstats

    prof.disable()
    stem = Path(args.profile) / f"{args.variant}-{args.method}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(stem) + ".prof")
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(60)
    Path(str(stem) + ".txt").write_text(buf.getvalue())


def rafl_member(name: str, num_classes: int, feature_dim: int):
    """The shim HtFLlib's ``BaseHeadSplit`` evals: rafl's zoo member ``name`` (``features`` ->
    ``head``), which BaseHeadSplit splits into ``base`` and ``head`` as it splits its own models."""
    from rafl.models import make_member

    return make_member(name, num_classes, feature_dim, 3, 32)


def htfllib_parser_args(system: Path, argv: list[str]) -> argparse.Namespace:
    """HtFLlib's command line parsed by ``main.py``'s own parser: the statements of its ``if
    __name__ == "__main__":`` block up to ``args = parser.parse_args()``, executed with ``argv``."""
    tree = ast.parse((system / "main.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body = []
    for stmt in block.body:
        body.append(stmt)
        if ast.unparse(stmt).replace(" ", "") == "args=parser.parse_args()":
            break
    else:
        raise SystemExit(f"{system / 'main.py'}: no 'args = parser.parse_args()' in its __main__ block")
    saved, sys.argv = sys.argv, ["main.py", *argv]
    try:
        ns: dict = {"argparse": argparse, "time": time, "os": os}
        exec(compile(ast.Module(body=body, type_ignores=[]), str(system / "main.py"), "exec"), ns)
    finally:
        sys.argv = saved
    return ns["args"]


class _Done(Exception):
    """Raised after the evaluation that follows the R-th training (module docstring)."""


def run_htfllib(args) -> dict:
    import importlib
    import logging
    import warnings

    import torch

    system = args.htfllib.resolve() / "system"
    sys.path.insert(0, str(system))
    os.chdir(args.cwd)  # HtFLlib reads ../dataset/<name>/ and writes ../results/ and temp/ relative to it
    torch.set_num_threads(1)
    algo = HTFL_ALGO[args.method.partition("@")[0]]
    hargs = htfllib_parser_args(system, [
        "-dev", "cpu", "-data", DATASET, "-ncl", "10", "-nc", str(args.clients), "-lbs", "10",
        "-gr", str(args.rounds), "-ls", "1", "-jr", "1", "-eg", "1", "-fd", str(args.feature_dim), "-algo", algo])
    # main.py's module-level settings
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    models = importlib.import_module("flcore.trainmodel.models")
    models.rafl_member = rafl_member
    hargs.models = [f"rafl_member({args.model!r}, num_classes=args.num_classes, feature_dim=args.feature_dim)"]
    serverbase = importlib.import_module("flcore.servers.serverbase")
    module, cls = HTFL_SERVER[algo]
    server_cls = getattr(importlib.import_module(module), cls)

    evals: list[dict] = []
    test_metrics, evaluate = serverbase.Server.test_metrics, serverbase.Server.evaluate

    def counted_test_metrics(self):
        ids, ns, correct, auc = test_metrics(self)
        evals[-1]["clients"] = [(int(n), float(c)) for n, c in zip(ns, correct)]
        return ids, ns, correct, auc

    def counted_evaluate(self, acc=None, loss=None):
        evals.append({"start": time.perf_counter(), "cpu_start": time.process_time()})
        out = evaluate(self, acc, loss)
        evals[-1]["end"], evals[-1]["cpu_end"] = time.perf_counter(), time.process_time()
        if len(evals) == args.rounds + 1:  # the evaluation after the R-th training
            raise _Done
        if len(evals) == 1 and prof:
            prof.enable()
        return out

    prof = _profiler(args)
    serverbase.Server.test_metrics = counted_test_metrics
    serverbase.Server.evaluate = counted_evaluate
    t_setup = time.perf_counter()
    server = server_cls(hargs, 0)
    setup = time.perf_counter() - t_setup
    try:
        server.train()
        raise SystemExit("HtFLlib's train() ended before the evaluation after round R")
    except _Done:
        pass
    server.save_results()
    _dump(args, prof)
    wall, cpu = time.perf_counter() - evals[0]["end"], time.process_time() - evals[0]["cpu_end"]
    last = evals[-1]["clients"]
    trained = [(n, c) for n, c in last if n >= 1]
    acc = {"mean": statistics.mean(c / n for n, c in trained), "pooled": sum(c for _, c in trained)
           / sum(n for n, _ in trained)}
    return {"wall_s": wall, "cpu_s": cpu, "setup_s": setup, "acc": acc, "algo": algo,
            "evaluate_s": sum(e["end"] - e["start"] for e in evals[1:]),
            "test_images": sum(n for n, _ in trained), "threads": torch.get_num_threads(),
            "h5py": importlib.import_module("h5py").__version__}


# ---------------------------------------------------------------------- the parent
def write_htfllib_dataset(data: Path, root: Path) -> dict:
    """The partition of ``data`` (:func:`round_speed.write_data`'s file) as HtFLlib's per-client
    ``.npz`` files under ``root/<DATASET>/``, normalized as rafl normalizes; returns the sizes."""
    import numpy as np
    import torch

    d = torch.load(data, weights_only=False)
    sizes = {"train": [], "test": []}
    for split in ("train", "test"):
        (root / DATASET / split).mkdir(parents=True, exist_ok=True)
        for cid, idx in enumerate(d[split]):
            x = d["pixels"][idx].float().mul_(d["a"]).add_(d["b"]).numpy().astype(np.float32)
            y = d["labels"][idx].numpy().astype(np.int64)
            with open(root / DATASET / split / f"{cid}.npz", "wb") as fh:
                np.savez_compressed(fh, data={"x": x, "y": y})
            sizes[split].append(len(y))
    return sizes


def spawn(args, variant: str, method: str, log: Path, cwd: Path | None = None) -> tuple[subprocess.Popen, Path]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    cmd = [sys.executable, __file__, "--variant", variant, "--method", method, "--json", str(out),
           "--cifar", str(args.cifar), "--seed", str(args.seed), "--model", args.model, "--clients", str(args.clients),
           "--rounds", str(args.rounds), "--limit-per-class", str(args.limit_per_class),
           "--feature-dim", str(args.feature_dim)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if args.profile:
        cmd += ["--profile", str(args.profile)]
    if variant == "htfllib":
        cmd += ["--htfllib", str(args.htfllib), "--cwd", str(cwd)]
        # HtFLlib's load_item calls torch.load without weights_only, written for torch < 2.6 (which
        # unpickled whole models by default): this restores that default for its process only
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        extra = [str(p) for p in args.htfllib_pythonpath]
        env["PYTHONPATH"] = os.pathsep.join([*extra, *filter(None, [env.get("PYTHONPATH")])])
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    proc.t0 = time.perf_counter()  # type: ignore[attr-defined]
    return proc, out


def run_together(args, jobs: list[tuple[str, str, Path, Path | None]]) -> list[dict]:
    """Start ``jobs`` (variant, method, log, cwd) at once; sample every tree's memory from ``/proc``
    (``round_speed._memory``) every 0.2 s until all exit; each one's result with its peak RSS / PSS
    (the sampled peak, or the kernel's exact peak RSS of the process, ``ru_maxrss``, if larger),
    process seconds and CPU seconds (``wait4``) and the load average at its start."""
    load = f"{os.getloadavg()[0]:.1f}"
    procs = [spawn(args, v, m, log, cwd) for v, m, log, cwd in jobs]
    peak = [[0, 0] for _ in procs]
    ended: list[tuple[float, int, object] | None] = [None] * len(procs)
    while any(e is None for e in ended):
        for i, (p, _) in enumerate(procs):
            if ended[i] is None:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    ended[i] = (time.perf_counter() - p.t0, os.waitstatus_to_exitcode(status), usage)  # type: ignore[attr-defined]
                    p.returncode = ended[i][1]
                    continue
                rss, pss = rs._memory(p.pid)
                peak[i] = [max(peak[i][0], rss), max(peak[i][1], pss)]
        time.sleep(0.2)
    res = []
    for (p, out), (variant, method, log, _), pk, (secs, code, usage) in zip(procs, jobs, peak, ended):
        if code != 0:
            tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
            raise SystemExit(f"{variant} {method} failed with exit code {code}:\n{tail}")
        r = json.loads(out.read_text())
        out.unlink()
        r.update(peak_rss_mb=max(pk[0] / 2**20, usage.ru_maxrss / 1024), sampled_rss_mb=pk[0] / 2**20,
                 maxrss_mb=usage.ru_maxrss / 1024, peak_pss_mb=pk[1] / 2**20, process_s=secs,
                 process_cpu_s=usage.ru_utime + usage.ru_stime, load=load)
        print(f"  {variant} {method}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                                      for k, v in r.items()}), flush=True)
        res.append(r)
    return res


def check_htfllib(args) -> str | None:
    """None, or the one line that says why HtFLlib cannot run here."""
    if args.htfllib is None:
        return ("needs --htfllib PATH, a checkout of HtFLlib (git clone https://github.com/TsingZ0/HtFLlib); "
                "nothing is downloaded at run time")
    system = args.htfllib / "system"
    missing = [p for p in ("main.py", "flcore/servers/serverproto.py", "utils/data_utils.py") if not (system / p).is_file()]
    if missing:
        return f"--htfllib {args.htfllib}: not an HtFLlib checkout (no system/{missing[0]})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, args.htfllib_pythonpath),
                                                        *filter(None, [os.environ.get("PYTHONPATH")])])}
    probe = subprocess.run([sys.executable, "-c", "import h5py, sklearn, torchvision"], env=env, capture_output=True)
    if probe.returncode != 0:
        return ("HtFLlib's modules import h5py, scikit-learn and torchvision, not all importable here: pip install "
                "h5py scikit-learn (or --htfllib-pythonpath DIR with them)")
    return None


def git_rev(path: Path, *paths: str) -> str:
    """``path``'s commit, and whether ``paths`` (relative to the checkout's root) have local changes."""
    try:
        rev = subprocess.check_output(["git", "-C", str(path), "rev-parse", "HEAD"], text=True,
                                      stderr=subprocess.DEVNULL).strip()
        top = subprocess.check_output(["git", "-C", str(path), "rev-parse", "--show-toplevel"], text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "-C", top, "status", "--porcelain", "--", *(paths or ["."])],
                                        text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return rev + (f" (with local changes in {', '.join(paths) or 'the tree'})" if dirty else "")


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(args, res: dict) -> str:
    niceness = res.get("niceness", 0)
    cmd = ((f"nice -n {niceness} " if niceness else "") + "python bench/htfllib_side_by_side.py --htfllib PATH "
           f"--limit-per-class {args.limit_per_class} --clients {args.clients} --rounds {args.rounds} "
           f"--repeats {args.repeats} --methods {','.join(args.methods)} --mode {args.mode}"
           + (f" --repeats-others {args.repeats_others}" if args.repeats_others is not None else ""))
    methods = [m for m in args.methods if m in res["methods"]]
    sz = res["sizes"]
    lines = [
        "# rafl vs HtFLlib, side by side: the same partition, model and hyperparameters",
        "",
        f"Command: `{cmd}`" + ("" if res.get("complete", True) else
                               f" -- interrupted: the methods it finished ({', '.join(methods)})"),
        "",
        f"Versions: rafl {res['rafl_version']} at {res['rafl_commit']}; HtFLlib (TsingZ0/HtFLlib) at "
        f"{res['htfllib_commit']}, its `system/` imported unchanged; torch {res['torch']}, h5py {res['h5py']}, "
        f"Python {res.get('python', '3')}.",
        "",
        f"Machine: {res.get('cores', '?')}, load average (1, 5, 15 min) {res['load_start']} at the start and "
        f"{res['load_end']} at the end (other jobs on the machine add to it; wall seconds depend on them, CPU "
        "seconds much less).",
        "",
        f"Scenario (`bench/round_speed.py`'s cnn4 scenario and partition code): CIFAR-10, {args.limit_per_class} "
        f"images per class of each split pooled, {args.clients} clients with 2 classes each (pathological), "
        f"{sum(sz['train'])} training images ({min(sz['train'])}-{max(sz['train'])} per client) and "
        f"{sum(sz['test'])} test images ({min(sz['test'])}-{max(sz['test'])} per client), `{args.model}` (D = "
        f"{args.feature_dim}), batch 10, 1 local epoch, SGD lr 0.01 without momentum or weight decay (HtFLlib's "
        f"defaults; rafl set to them), every client every round, every client evaluated every round, "
        f"{args.rounds} rounds, 1 torch thread per process. Mode `{args.mode}`: "
        + ("both processes of a pair started together" if args.mode == "pairs" else
           "one process at a time, the order swapped each repeat") + "; medians over the repeats.",
        "",
        "What each time covers (the bench's docstring): **rafl** `federate.run` (R rounds of training, "
        "server step and evaluation, and the engine's files, summary and plots; not the data loading or "
        "model building); **HtFLlib** from the end of its round-0 evaluation to the end of `save_results()` "
        "(R trainings, server steps and evaluations, with its per-round re-reading of every client's `.npz` "
        "files and its `torch.save`/`torch.load` of every model through files; not the server's construction, "
        "its `setup`). `CPU` is the process's CPU time over the same span, `process` the whole process "
        "(start to exit: imports, data loading, everything).",
        "",
        "| method (HtFLlib) | wall s rafl / HtFLlib | **wall rafl / HtFLlib** | CPU s rafl / HtFLlib | "
        "**CPU rafl / HtFLlib** | process s rafl / HtFLlib | peak RSS MB rafl / HtFLlib | **RSS rafl / HtFLlib** | "
        "accuracy rafl / HtFLlib (mean; pooled) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        r, h = res["methods"][m]["rafl"], res["methods"][m]["htfllib"]
        key = RAFL_ACC[m.partition("@")[0]]
        ra, ha = r[-1]["acc"][key], h[-1]["acc"]
        wr = [a["wall_s"] / b["wall_s"] for a, b in zip(r, h)]
        cr = [a["cpu_s"] / b["cpu_s"] for a, b in zip(r, h)]
        rss_r, rss_h = max(x["peak_rss_mb"] for x in r), max(x["peak_rss_mb"] for x in h)
        lines.append(
            f"| {m} ({HTFL_ALGO[m.partition('@')[0]]}) | {med(r, 'wall_s'):.1f} / {med(h, 'wall_s'):.1f} | "
            f"**{statistics.median(wr):.2f}x** | {med(r, 'cpu_s'):.1f} / {med(h, 'cpu_s'):.1f} | "
            f"**{statistics.median(cr):.2f}x** | {med(r, 'process_s'):.0f} / {med(h, 'process_s'):.0f} | "
            f"{rss_r:.0f} / {rss_h:.0f} | **{rss_r / rss_h:.2f}x** | "
            f"{key} {ra['mean']:.3f} / {ha['mean']:.3f}; {ra['pooled']:.3f} / {ha['pooled']:.3f} |")
    lines += [
        "",
        "Ratios: the median of the per-pair ratios (repeat i of rafl against repeat i of HtFLlib). Peak RSS: the "
        "largest over the repeats. Accuracy: the last repeat's final round (the repeats of a side gave the same "
        "numbers); FedProto / FedTGP: the nearest global prototype (`proto`), FedGH / Local: the model's head "
        "(rafl's `model`).",
        "",
        "Every run (wall s / CPU s / peak RSS MB / load average at its start), rafl; HtFLlib:",
        "",
    ]
    for m in methods:
        r, h = res["methods"][m]["rafl"], res["methods"][m]["htfllib"]

        def runs(xs):
            return ", ".join(f"{x['wall_s']:.1f} / {x['cpu_s']:.1f} / {x['peak_rss_mb']:.0f} / {x['load']}" for x in xs)

        lines.append(f"- {m}: {runs(r)}; {runs(h)}. HtFLlib setup {med(h, 'setup_s'):.1f} s; rafl rounds "
                     f"{med(r, 'rounds_s'):.1f} s of which client steps {med(r, 'client_update_s'):.1f} s, "
                     f"evaluation {med(r, 'evaluate_s'):.1f} s; HtFLlib evaluation {med(h, 'evaluate_s'):.1f} s.")
    lines += [
        "",
        "rafl's other accuracies (final round, mean over clients): " + "; ".join(
            f"{m} " + ", ".join(f"{k} {v['mean']:.3f}" for k, v in res["methods"][m]["rafl"][-1]["acc"].items())
            for m in methods) + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--htfllib", type=Path, default=None, help="a checkout of TsingZ0/HtFLlib")
    ap.add_argument("--htfllib-pythonpath", type=Path, action="append", default=[],
                    help="a directory added to the HtFLlib process's PYTHONPATH (e.g. one holding h5py)")
    ap.add_argument("--cifar", type=Path, default=rs.TREE if rs.TREE.is_dir() else rs.TARBALL)
    ap.add_argument("--model", default="cnn4")
    ap.add_argument("--feature-dim", type=int, default=128)
    ap.add_argument("--limit-per-class", type=int, default=100)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of FedProto (the first method)")
    ap.add_argument("--repeats-others", type=int, default=None, help="pairs of the other methods (default --repeats)")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["fedproto", "fedgh", "fedtgp", "standalone"])
    ap.add_argument("--mode", choices=["pairs", "alternate"], default="pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "htfllib_side_by_side")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile each process's timed span into DIR "
                    "(<variant>-<method>.prof and .txt; its times are the profiler's, not for the tables)")
    ap.add_argument("--render", type=Path, default=None, help="write --out's .md from this .json again, run nothing")
    ap.add_argument("--variant", choices=["rafl", "htfllib"], help=argparse.SUPPRESS)
    ap.add_argument("--method", default="fedproto", help=argparse.SUPPRESS)
    ap.add_argument("--cwd", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.scenario, args.alpha, args.batch_size, args.workers = "cnn4", 0.5, 10, 1  # round_speed's overrides / write_data
    if args.variant:
        out = {"rafl": run_rafl, "htfllib": run_htfllib}[args.variant](args)
        args.json.write_text(json.dumps(out))
        return
    if args.render:
        render(args.render, args.out)
        return
    why = check_htfllib(args)
    if why:
        print(f"htfllib_side_by_side: {why}", file=sys.stderr)
        raise SystemExit(2)
    unknown = [m for m in args.methods if m.partition("@")[0] not in HTFL_ALGO]
    if unknown:
        print(f"htfllib_side_by_side: --methods {unknown[0]}: allowed {', '.join(HTFL_ALGO)}", file=sys.stderr)
        raise SystemExit(2)
    import torch

    import rafl

    res: dict = {"load_start": rs.load_now(), "methods": {}, "rafl_version": rafl.__version__, "niceness": os.nice(0),
                 "python": sys.version.split()[0], "cores": f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable)",
                 "rafl_commit": git_rev(ROOT, "rafl", "bench"), "torch": torch.__version__,
                 "htfllib_commit": git_rev(args.htfllib, "system/main.py", "system/flcore", "system/utils")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data.pt"
        rs.write_data(types.SimpleNamespace(**{**vars(args), "methods": [m.partition("@")[0] for m in args.methods]}),
                      args.limit_per_class, args.clients, data)
        res["sizes"] = write_htfllib_dataset(data, tmp / "dataset")
        for i, m in enumerate(args.methods):
            repeats = args.repeats if i == 0 or args.repeats_others is None else args.repeats_others
            runs: dict[str, list[dict]] = {"rafl": [], "htfllib": []}
            for rep in range(repeats):
                cwd = tmp / f"run-{m}-{rep}"
                cwd.mkdir()
                jobs = [("rafl", m, tmp / f"rafl-{m}-{rep}.log", None), ("htfllib", m, tmp / f"htfllib-{m}-{rep}.log", cwd)]
                if rep % 2:
                    jobs.reverse()
                if args.mode == "pairs":
                    done = run_together(args, jobs)
                else:
                    done = [run_together(args, [j])[0] for j in jobs]
                for (variant, *_), r in zip(jobs, done):
                    runs[variant].append(r)
            res["methods"][m] = runs
            res["load_end"] = rs.load_now()
            write(args, res, complete=i == len(args.methods) - 1)  # what is done so far survives an interruption
    print(args.out.with_suffix(".md").read_text())


#: the arguments the report reads (written into the .json; ``--render`` reads them back)
REPORT_ARGS = ("limit_per_class", "clients", "rounds", "repeats", "repeats_others", "methods", "mode", "model",
               "feature_dim", "seed")


def write(args, res: dict, complete: bool) -> None:
    """``--out``'s .json (the arguments, every run's figures) and .md (:func:`report`)."""
    res["h5py"] = res["methods"][next(iter(res["methods"]))]["htfllib"][0]["h5py"]
    res["complete"] = complete
    saved = {"args": {k: getattr(args, k) for k in REPORT_ARGS}, **res}
    args.out.with_suffix(".json").write_text(json.dumps(saved, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(args, res) + "\n")


def render(path: Path, out: Path) -> None:
    """``--render JSON``: the .md of a .json this bench wrote, again (after a change to the report)."""
    saved = json.loads(path.read_text())
    args = types.SimpleNamespace(**saved.pop("args"), out=out)
    out.with_suffix(".md").write_text(report(args, saved) + "\n")


if __name__ == "__main__":
    main()
