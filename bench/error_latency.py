"""How fast bad input is answered: every bad-input case of issue 57 run as ``rafl ...`` in a
subprocess, each paired back to back with ``rafl --help`` (the floor: Python, click and rafl's CLI
module, no command), so a loaded machine moves both alike.

For each case: the exit status (2 expected), the seconds (median of ``--repeats`` runs), the ratio
to ``rafl --help``'s seconds in the same pairs, whether torch was imported (``'torch' in
sys.modules`` when the process exits, written by a small wrapper around ``rafl.cli.main``), how
many lines stderr held (1 expected: ``error: ...``), and whether anything was written into the
case's scratch folder or the cache (nothing expected). Every case runs with an empty
``RAFL_CACHE_DIR`` and ``RAFL_DATA_ROOT`` naming a folder that does not exist, in a fresh scratch
folder as its working directory.

Run: ``python bench/error_latency.py [--repeats 3] [--only federate]`` (writes
``bench/results/error_latency.md``; about a minute on 2 cores). Exit status 1 if a case did not
exit 2, printed more than one line, imported torch or wrote something.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: runs ``rafl.cli.main`` on argv[1:] and writes whether torch was imported to $ERROR_LATENCY_PROBE
WRAPPER = """\
import atexit, os, sys
atexit.register(lambda: open(os.environ["ERROR_LATENCY_PROBE"], "w").write(str("torch" in sys.modules)))
from rafl.cli import main
main(sys.argv[1:])
"""

#: (what it is, argv after ``rafl``); ``{tmp}`` is the case's scratch folder, which holds
#: ``bad.yaml`` (not YAML), ``text.txt`` (a text file), ``run/`` (a folder that is not a run dir) and
#: ``tiny.yaml`` (a device with a budget of 0.01 M MACs, below every subnet of the shipped supernet)
CASES: list[tuple[str, list[str]]] = [
    # rafl federate: the run config
    ("run config file missing", ["federate", "--config", "{tmp}/none.yaml"]),
    ("run config not YAML", ["federate", "--config", "{tmp}/bad.yaml"]),
    ("value out of range", ["federate", "--set", "engine.rounds=0"]),
    ("unknown key", ["federate", "--set", "engine.roundz=3"]),
    ("unknown device profile", ["federate", "--set", "clients.profiles=[pi5]"]),
    ("negative budget", ["federate", "--set", "clients.budgets.pi4.latency_ms=-1"]),
    ("unknown method", ["federate", "--set", "algorithm.name=fedx"]),
    ("unknown hyperparameter", ["federate", "--set", "algorithm.lrr=0.1"]),
    ("unknown option", ["federate", "--rounds", "3"]),
    # rafl federate: fields that contradict each other
    ("clients_per_round > clients.n", ["federate", "--set", "engine.clients_per_round=20"]),
    ("min_valid_uploads > sampled", ["federate", "--set", "engine.min_valid_uploads=11"]),
    ("pathological without k", ["federate", "--set", "partition.scheme=pathological"]),
    ("no public pool for the search", ["federate", "--set", "partition.public_fraction=0"]),
    ("quickstart supernet on cifar10", ["federate", "--set", "data.dataset=cifar10"]),
    # rafl federate: folders and data
    ("--data-root with --resume", ["federate", "--data-root", "{tmp}", "--resume", "{tmp}"]),
    ("--resume folder missing", ["federate", "--resume", "{tmp}/none"]),
    ("--resume folder not a run", ["federate", "--resume", "{tmp}/run"]),
    ("data root missing", ["federate", "--set", "supernet.path=cifar10", "--set", "data.dataset=cifar10",
                           "--data-root", "{tmp}/none"]),
    ("data root not a dataset", ["federate", "--set", "supernet.path=cifar10", "--set", "data.dataset=cifar10",
                                 "--data-root", "{tmp}/text.txt"]),
    # rafl compare
    ("compare: value out of range", ["compare", "--out", "{tmp}/c", "--set", "partition.alpha=0"]),
    ("compare: --out is a file", ["compare", "--out", "{tmp}/bad.yaml"]),
    ("compare: unknown method", ["compare", "--out", "{tmp}/c", "--algorithms", "rafl,fedx"]),
    # rafl search
    ("search: unknown device profile", ["search", "--device-profile", "pi5"]),
    ("search: supernet missing", ["search", "--device-profile", "pi4", "--supernet", "{tmp}/none"]),
    ("search: data root missing", ["search", "--device-profile", "pi4", "--supernet", "cifar10",
                                   "--data-root", "{tmp}/none"]),
    ("search: budget below the smallest subnet", ["search", "--device-profile", "{tmp}/tiny.yaml",
                                                  "--supernet", "cifar10", "--out", "{tmp}/s"]),
    # rafl data, profile, supernet
    ("data: unknown dataset", ["data", "--dataset", "cifar11", "--out", "{tmp}/d"]),
    ("profile: bad --arch", ["profile", "--device-profile", "pi4", "--arch", "r32_k9e9", "--out", "{tmp}/p"]),
    ("supernet train: data root missing", ["supernet", "train", "--dataset", "cifar10", "--data-root",
                                           "{tmp}/none", "--out", "{tmp}/n"]),
]


def _scratch(base: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(dir=base))
    (tmp / "bad.yaml").write_text("engine: [1\n")
    (tmp / "text.txt").write_text("not a dataset\n")
    (tmp / "tiny.yaml").write_text("name: tiny\nthroughput_gmacs: 4.72\nmem_bandwidth_gbs: 0.572\n"
                                   "budgets: {macs_m: 0.01}\n")
    (tmp / "run").mkdir()
    (tmp / "run" / "notes.txt").write_text("not a run dir\n")
    return tmp


def _listing(*folders: Path) -> set[str]:
    return {str(p) for f in folders for p in f.rglob("*")}


def run_once(argv: list[str], base: Path, timeout: float) -> dict:
    """One run of ``rafl argv`` in a fresh scratch folder: exit status, seconds, torch imported,
    stderr lines, files written."""
    tmp = _scratch(base)
    cache = tmp / "cache"
    cache.mkdir()
    probe = tmp / "probe"
    args = [a.replace("{tmp}", str(tmp)) for a in argv]
    env = {**os.environ, "RAFL_CACHE_DIR": str(cache), "RAFL_DATA_ROOT": str(tmp / "no-data"),
           "ERROR_LATENCY_PROBE": str(probe), "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    before = _listing(tmp) - {str(probe)}
    t0 = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, env=env,
                             cwd=tmp, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # still working after the limit: it did not refuse the input
        res = subprocess.CompletedProcess(err.cmd, "timeout", "", (err.stderr or b"").decode(errors="replace"))
    seconds = time.perf_counter() - t0
    torch = probe.read_text() == "True" if probe.is_file() else None
    written = sorted(_listing(tmp) - before - {str(probe)})
    lines = res.stderr.strip().splitlines()
    return {"rc": res.returncode, "s": seconds, "torch": torch, "lines": len(lines),
            "first": lines[0] if lines else "", "written": [w.replace(str(tmp), "{tmp}") for w in written]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="pairs (case, --help) per case; the median is kept")
    ap.add_argument("--only", default=None, help="run only the cases whose command or name contains this")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds after which a case is stopped")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "error_latency.md")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: must be >= 1")
    cases = [c for c in CASES if args.only is None or args.only in c[0] or args.only in " ".join(c[1])]
    if not cases:
        ap.error(f"--only {args.only!r}: no case matches")
    rows = []
    with tempfile.TemporaryDirectory(prefix="error-latency-") as base:
        for name, argv in cases:
            runs, helps = [], []
            for _ in range(args.repeats):
                runs.append(run_once(argv, Path(base), args.timeout))
                helps.append(run_once(["--help"], Path(base), args.timeout))
            s, h = statistics.median(r["s"] for r in runs), statistics.median(r["s"] for r in helps)
            last = runs[-1]
            ok = (all(r["rc"] == 2 and r["torch"] is False and r["lines"] == 1 and not r["written"] for r in runs)
                  and last["first"].startswith("error: "))
            rows.append({"case": name, "argv": argv, "rc": last["rc"], "s": s, "help_s": h, "ratio": s / h,
                         "torch": any(r["torch"] for r in runs), "lines": max(r["lines"] for r in runs),
                         "written": sorted({w for r in runs for w in r["written"]}), "message": last["first"],
                         "ok": ok})
            r = rows[-1]
            print(f"{'ok ' if ok else 'BAD'} {name:36s} exit {r['rc']}  {s:5.2f} s  x{r['ratio']:4.2f} of --help  "
                  f"torch {'yes' if r['torch'] else 'no '}  lines {r['lines']}"
                  + (f"  wrote {', '.join(r['written'][:3])}" if r["written"] else ""), flush=True)
    write_report(args.out, rows, args.repeats)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases answered in one line, exit 2, without torch, nothing "
          f"written; slowest {max(r['s'] for r in rows):.2f} s (x{max(r['ratio'] for r in rows):.2f} of --help); "
          f"wrote {args.out}")
    return 1 if bad else 0


def write_report(out: Path, rows: list[dict], repeats: int) -> None:
    """``error_latency.md``: the table and the message of every case."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Bad input answered before torch loads (issue 57)",
        "",
        f"`python bench/error_latency.py --repeats {repeats}` on a {os.cpu_count()}-core "
        f"{platform.machine()} machine, Python {platform.python_version()}, load average {load:.1f} at the end. "
        f"Each case is `rafl ARGS` in a subprocess with an empty `RAFL_CACHE_DIR` and `RAFL_DATA_ROOT` naming a "
        f"missing folder, paired back to back with `rafl --help`; seconds are the median of {repeats} runs, the "
        "ratio is to `rafl --help`'s median in the same pairs. `torch`: whether torch was in `sys.modules` when "
        "the process exited; `lines`: lines on stderr; `written`: files made in the case's folder.",
        "",
        f"{sum(r['ok'] for r in rows)} of {len(rows)} cases: exit 2, one line, no torch, nothing written. "
        f"Slowest {max(r['s'] for r in rows):.2f} s; `rafl --help` {statistics.median(r['help_s'] for r in rows):.2f} s "
        "(median over the pairs).",
        "",
        "| case | command | exit | seconds | x `--help` | torch | lines | written |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | `rafl {' '.join(r['argv'])}` | {r['rc']} | {r['s']:.2f} | {r['ratio']:.2f} | "
                     f"{'yes' if r['torch'] else 'no'} | {r['lines']} | {', '.join(r['written']) or '-'} |")
    lines += ["", "## The answers", ""]
    lines += [f"- {r['case']}: `{r['message']}`" for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
