"""Reliability bench: hostile uploads per method, fuzzed loaders, ``kill -9`` and resume.

1. **Hostile uploads.** For every method, a real round 1 on a tiny federation (digits, 3 clients,
   width-0.25 supernet subnets; FedAvg/FedProx/FedNova one shared arch): the three honest uploads
   of ``client_update``, then client 1's upload replaced by each hostile class (a claimed
   ``n_samples`` of 10**12 / True / 10**400, float64 / float16 / bfloat16 / bool / complex-NaN
   tensors, an int64 of 2**40, NaN, Inf, all 3e38, a wrong shape, a missing tensor, an extra tensor
   over the byte limit, a metadata string over it, and an in-range "boosted" update x100). Each is
   screened as the engine does (:func:`rafl.federation.screening.screen_uploads`); an accepted one
   is aggregated and compared with the aggregate of the honest upload: ``rejected``,
   ``accepted-harmless`` (the same aggregate, bit for bit) or ``accepted-harmful`` (max |delta|).
   Measured on FedAvg and RaFL: how far a 10**12-sample claim moves the average compared with the
   honest client (and the share the old rule, weights from the claim, gave it), the boosted
   update under each ``engine.aggregation``, and the peak RSS of rejecting a 400 MB extra tensor
   and a 200 MB metadata string.
2. **Fuzzed loaders.** ``tests/test_fuzz_loaders.py``'s mutations with ``--fuzz-examples`` per
   loader: outcomes parsed / rejected (one UserInputError) / anything else, slowest case and peak
   Python memory.
4. **One hostile node** (``--only-nodes`` adds them to an existing table): a BatchNorm running
   variance of -1e5 every round, a lone boosted upload (its move over the carried clip bound), a
   client step raising a rafl error on every backend (in-process, workers, Flower messages with a
   SuperLink's semantics, Flower's Simulation Runtime), a background ``rafl federate`` sent SIGINT;
   the default rule beside ``mean``.
3. **kill -9.** ``rafl federate`` (FedGH, cnn4-small group, 3 clients, 4 rounds) killed with
   SIGKILL before its first checkpoint (rerun under the same name), mid-round 2 (``--resume``) and
   during that resume (``--resume`` again); the final metrics against an uninterrupted run.

Run: ``python bench/reliability.py [--fuzz-examples 200] [--skip-kill] [--methods A,B] [--out NAME]``;
writes ``bench/results/NAME.md`` and ``.json`` (default ``reliability``; about 35 minutes on 2
loaded cores for every method). ``--fuzz-examples 0`` skips the fuzzing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
METHODS = ["fedavg", "fedprox", "fednova", "rafl", "fml", "lg-fedavg", "fedkd", "feddf", "fedproto", "fedtgp",
           "fedgh", "fd", "heterofl", "fedrolex", "uniform"]
SAME_MODEL = ["clients.arch=r16_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3"]
THREE_MODELS = ["clients.archs={pi4: r16_k7e6.k3e4|k7e4.k5e6|k7e4.k3e3|k5e3.k7e4|k3e3.k3e4, "
                "jetson-nano: r16_k7e4.k7e4.k3e6|k7e4.k5e3.k7e3|k7e3.k5e3|k5e3.k7e4|k5e3.k7e6.k5e3, "
                "phone: r16_k5e4.k3e4|k3e4.k5e6.k7e3|k7e3.k7e4.k5e4.k5e6|k5e6.k7e4.k7e4|k5e6.k5e6.k3e4.k3e4}"]


# ---------------------------------------------------------------------- 1. hostile uploads
def tiny_supernet(folder: Path) -> Path:
    from rafl.supernet import SearchSpace, build_supernet, save_supernet

    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(16,), n_classes=10)
    save_supernet(folder, build_supernet(space).eval(), config={"public_fraction": 0.3, "public_seed": 0}, metrics={})
    return folder


def honest_round(method: str, supernet: Path):
    """``(fed, server_state, server ctx, [(cid, upload)], policy)`` of round 1."""
    from rafl.federation.aggregation import AggregationRule
    from rafl.federation.run_config import load_run_config
    from rafl.federation.runners import client_context
    from rafl.federation.screening import UploadPolicy
    from rafl.seeds import SeedTree
    from rafl.stages import federate

    sets = [f"supernet.path={supernet}", "data.limit_per_class=10", "clients.n=3", "engine.rounds=1",
            f"algorithm.name={method}", "algorithm.local_epochs=1",
            *(SAME_MODEL if method in ("fedavg", "fedprox", "fednova") else THREE_MODELS)]
    prep = federate.prepare(load_run_config(None, sets), progress=False)
    fed, algo = prep.federation, prep.federation.algorithm
    torch.manual_seed(SeedTree(0).server(0))  # as the engine seeds init_server
    server = fed.server
    server.round, server.seed = 0, SeedTree(0).server(0)
    state, broadcast = algo.init_server(server)
    uploads = []
    for cid in range(3):
        ctx = client_context(fed, 0, cid, 1)
        torch.manual_seed(ctx.init_seed)
        cstate = algo.init_client(ctx)
        torch.manual_seed(ctx.seed)
        _, up = algo.client_update(cstate, algo.client_broadcast(broadcast, fed.clients[cid]), ctx)
        uploads.append((cid, up))
    from rafl.config import EngineConfig

    default = EngineConfig()
    server.round, server.aggregation = 1, AggregationRule(default.aggregation, default.trim_fraction, default.clip_norm)
    return fed, state, server, uploads, UploadPolicy()


def copy_upload(p):
    from rafl.federation.payload import Payload

    return Payload({k: v.clone() for k, v in p.tensors.items()}, dict(p.meta))


def attacks(up, limit: int) -> dict:
    """name -> hostile version of ``up`` (None: not applicable to this payload)."""
    from rafl.federation.payload import Payload

    floats = [k for k, v in up.tensors.items() if v.is_floating_point() and v.numel()]
    ints = [k for k, v in up.tensors.items() if not v.is_floating_point()]
    f = floats[0] if floats else None

    def with_tensor(name, t):
        return Payload({**up.tensors, name: t}, dict(up.meta))

    def with_meta(**kw):
        return Payload(dict(up.tensors), {**up.meta, **kw})

    out = {
        "claims n_samples=10**12": with_meta(n_samples=10**12),
        "claims n_samples=True": with_meta(n_samples=True),
        "claims n_samples=10**400": with_meta(n_samples=10**400),
        "float64 tensor": f and with_tensor(f, up.tensors[f].double()),
        "float16 tensor": f and with_tensor(f, up.tensors[f].half()),
        "bfloat16 tensor": f and with_tensor(f, up.tensors[f].bfloat16()),
        "bool tensor": f and with_tensor(f, up.tensors[f] > 0),
        "complex NaN tensor": f and with_tensor(f, torch.full(up.tensors[f].shape, complex(math.nan, 0))),
        "int64 of 2**40": with_tensor(ints[0], torch.full(up.tensors[ints[0]].shape, 2**40, dtype=torch.int64)) if ints else
        with_tensor("counter", torch.tensor(2**40)),
        "NaN values": f and with_tensor(f, up.tensors[f] * math.nan),
        "Inf values": f and with_tensor(f, up.tensors[f] + math.inf),
        "all 3e38": Payload({k: torch.full_like(v, 3e38) if v.is_floating_point() else v for k, v in up.tensors.items()},
                            dict(up.meta)),
        "wrong shape (+3 columns)": f and with_tensor(f, torch.zeros(*up.tensors[f].shape[:-1],
                                                                    up.tensors[f].shape[-1] + 3)),
        "missing tensor": Payload({k: v for k, v in up.tensors.items() if k != f}, dict(up.meta)) if f else None,
        "extra tensor over the byte limit": with_tensor("junk", torch.zeros(limit // 4 + 1)),
        "metadata string over the byte limit": with_meta(note="x" * (limit + 1)),
        "boosted update x100 (in range)": Payload({k: v * 100 if v.is_floating_point() else v
                                                   for k, v in up.tensors.items()}, dict(up.meta)),
    }
    return {k: v for k, v in out.items() if v is not None}


def aggregate(algo, accepted, state, server):
    from rafl.seeds import SeedTree

    torch.manual_seed(SeedTree(0).server(1))  # as the engine seeds round 1's server step
    server.round, server.seed = 1, SeedTree(0).server(1)

    _, broadcast = algo.server_aggregate(accepted, state, server)
    return broadcast


def max_delta(a, b) -> float:
    """Max |a - b| over the tensors of two payloads; per-class rows (``*values`` beside
    ``*labels``) are compared on the classes both hold (a client left out may take a class away)."""
    keys = set(a.tensors) | set(b.tensors)
    if set(a.tensors) != set(b.tensors):
        return math.inf
    out = 0.0
    for k in keys:
        x, y = a.tensors[k], b.tensors[k]
        lab = k[:-len("values")] + "labels" if k.endswith("values") else None
        if x.shape != y.shape and lab in a.tensors:
            rows_x = dict(zip(a.tensors[lab].tolist(), x))
            rows_y = dict(zip(b.tensors[lab].tolist(), y))
            common = sorted(set(rows_x) & set(rows_y))
            x = torch.stack([rows_x[c] for c in common]) if common else torch.zeros(0)
            y = torch.stack([rows_y[c] for c in common]) if common else torch.zeros(0)
        elif x.shape != y.shape:
            if k.endswith("labels"):
                continue
            return math.inf
        if x.numel():
            out = max(out, float((x.double() - y.double()).abs().max()))
    return out


def screen(fed, state, policy, results):
    from rafl.federation.screening import screen_uploads

    algo = fed.algorithm
    limits = {c: policy.byte_limit(algo.upload_spec(state, fed.clients[c])) for c, _ in results}
    return screen_uploads(results, algo, state, fed.clients, fed.server.n_classes, policy, limits=limits,
                          sender=lambda c: f"client {c}")


def hostile_uploads(supernet: Path, methods: list[str]) -> dict:
    from rafl.errors import UserInputError

    table, extra, influence = {}, {}, {}
    for method in methods:
        t0 = time.perf_counter()
        fed, state, server, honest, policy = honest_round(method, supernet)
        algo = fed.algorithm
        ref = aggregate(algo, screen(fed, state, policy, [(c, copy_upload(u)) for c, u in honest]).accepted, state,
                        server)
        limit = policy.byte_limit(algo.upload_spec(state, fed.clients[1]))
        rows = {}
        for name, bad in attacks(honest[1][1], limit).items():
            res = [(0, copy_upload(honest[0][1])), (1, bad), (2, copy_upload(honest[2][1]))]
            out = screen(fed, state, policy, res)
            if 1 in out.rejected:
                rows[name] = {"outcome": "rejected", "reason": out.rejected[1].split(": ", 1)[1][:110]}
                continue
            try:
                d = max_delta(aggregate(algo, out.accepted, state, server), ref)
            except UserInputError as err:  # the server step itself failed on the accepted upload
                rows[name] = {"outcome": "accepted-harmful", "max_abs_delta": math.inf,
                              "server_step_error": str(err)[:160]}
                continue
            rows[name] = {"outcome": "accepted-harmless" if d == 0 else "accepted-harmful", "max_abs_delta": d}
        table[method] = rows
        print(f"{method}: {sum(r['outcome'] == 'rejected' for r in rows.values())} rejected, "
              f"{sum(r['outcome'] == 'accepted-harmless' for r in rows.values())} harmless, "
              f"{sum(r['outcome'] == 'accepted-harmful' for r in rows.values())} harmful "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        influence[method] = boosted_influence(fed, state, server, honest, policy)
        print(f"  boosted x100 influence / largest honest: {influence[method]}", flush=True)
        if method in ("fedavg", "rafl"):
            extra[method] = claim_and_robust(fed, state, server, honest, policy)
    extra["memory"] = big_rejections(supernet)
    return {"table": table, "influence": influence, **extra}


def claim_and_robust(fed, state, server, honest, policy) -> dict:
    """The 10**12 claim's displacement vs the honest client's, and the boosted update per rule."""
    from rafl.federation.aggregation import AggregationRule, weighted_average

    algo = fed.algorithm
    without = aggregate(algo, screen(fed, state, policy, [(c, copy_upload(u)) for c, u in honest if c != 1]).accepted,
                        state, server)

    def moved(claim):
        bad = copy_upload(honest[1][1])
        bad.meta["n_samples"] = claim
        res = [(0, copy_upload(honest[0][1])), (1, bad), (2, copy_upload(honest[2][1]))]
        return max_delta(aggregate(algo, screen(fed, state, policy, res).accepted, state, server), without)

    n = [fed.clients[c].n_samples for c in range(3)]
    old_share = 1e12 / (1e12 + n[0] + n[2])  # what weights from the claim gave the attacker
    prefix = "knowledge." if algo.name == "rafl" else ""
    states = [u.state_dict(prefix) for _, u in honest]
    old_rule = weighted_average([states[0], states[1], states[2]], [n[0], 1e12, n[2]])
    key = next(k for k, v in states[1].items() if v.is_floating_point() and v.numel() > 1)
    attacker_share = float(((old_rule[key].double() - states[0][key].double()).norm()
                            / (states[1][key].double() - states[0][key].double()).norm()))
    robust = {}
    for rule in (AggregationRule("mean"), AggregationRule("median"), AggregationRule("trimmed_mean", trim_fraction=0.34),
                 AggregationRule("norm_clip")):
        server.aggregation = rule
        ref = aggregate(algo, screen(fed, state, policy, [(c, copy_upload(u)) for c, u in honest]).accepted, state,
                        server)
        boosted = copy_upload(honest[1][1])
        boosted.tensors = {k: v * 100 if v.is_floating_point() else v for k, v in boosted.tensors.items()}
        res = [(0, copy_upload(honest[0][1])), (1, boosted), (2, copy_upload(honest[2][1]))]
        robust[rule.name] = max_delta(aggregate(algo, screen(fed, state, policy, res).accepted, state, server), ref)
    server.aggregation = AggregationRule()
    return {"honest_client_moves": moved(n[1]), "claim_1e12_moves": moved(10**12),
            "old_rule_attacker_share": old_share, "old_rule_measured_share": attacker_share,
            "boosted_x100_max_delta_by_rule": robust, "registered_n": n}


RULES = ("mean", "median", "trimmed_mean", "norm_clip")


def boosted_influence(fed, state, server, honest, policy) -> dict:
    """Per ``engine.aggregation`` rule: how far client 1's boosted (x100) upload moves the server's
    broadcast (leave-one-out: the max |delta| of the broadcast with it against the one without it)
    over how far the most influential honest client moves it in the same round (``same_round``:
    the same leave-one-out of clients 0 and 2), and over the most influential client of the round
    had all three been honest (``vs_honest_round``); <= 1 meets the target "no single client
    changes the global model more than the largest honest client"."""
    from rafl.errors import UserInputError
    from rafl.federation.aggregation import AggregationRule

    algo = fed.algorithm
    boosted = copy_upload(honest[1][1])
    boosted.tensors = {k: v * 100 if v.is_floating_point() else v for k, v in boosted.tensors.items()}
    out = {}
    saved = server.aggregation
    for name in RULES:
        server.aggregation = AggregationRule(name, trim_fraction=0.34 if name == "trimmed_mean" else 0.1)
        sent = [(0, copy_upload(honest[0][1])), (1, boosted), (2, copy_upload(honest[2][1]))]
        clean = [(c, copy_upload(u)) for c, u in honest]

        def agg(results):
            return aggregate(algo, screen(fed, state, policy, results).accepted, state, server)

        try:
            attacked = agg(sent)
            moves = [max_delta(attacked, agg([(c, u if c == 1 else copy_upload(u)) for c, u in sent if c != left]))
                     for left in (0, 1, 2)]
            everyone = agg(clean)
            honest_moves = [max_delta(everyone, agg([(c, copy_upload(u)) for c, u in clean if c != h]))
                            for h in (0, 1, 2)]
            out[name] = {"same_round": moves[1] / max(moves[0], moves[2], 1e-30),
                         "vs_honest_round": moves[1] / max(max(honest_moves), 1e-30)}
        except UserInputError as err:  # the server step itself failed on the boosted upload
            out[name] = f"server step failed: {str(err)[:80]}"

    server.aggregation = saved
    return out


def boosted_rounds(supernet: Path, methods: list[str], rounds: int = 6) -> dict:
    """``rounds`` rounds of the engine (in-process) for every method and rule, client 1 of 3 sending
    its honest upload x100 every round: rounds failed, honest uploads rejected, the run's final
    accuracy, against the same rule's run without the attacker."""
    import shutil

    from rafl.federation.algorithms import ALGORITHMS
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    out: dict = {}
    for method in methods:
        base = ALGORITHMS[method]

        class Boosted(base):  # client 1 sends its honest upload x100 (in range) every round
            def client_update(self, state, broadcast, client):
                state, up = super().client_update(state, broadcast, client)
                if client.client_id == 1:
                    up.tensors = {k: v * 100 if v.is_floating_point() else v for k, v in up.tensors.items()}
                return state, up

        Boosted.__name__ = base.__name__
        for rule in RULES:
            row = {}
            for attacked in (False, True):
                sets = [f"supernet.path={supernet}", "data.limit_per_class=10", "clients.n=3", f"engine.rounds={rounds}",
                        f"engine.eval_every={rounds}", f"engine.aggregation={rule}", "engine.workers=1",
                        f"algorithm.name={method}", "algorithm.local_epochs=1",
                        *(["engine.trim_fraction=0.34"] if rule == "trimmed_mean" else []),
                        *(SAME_MODEL if method in ("fedavg", "fedprox", "fednova") else THREE_MODELS)]
                prep = federate.prepare(load_run_config(None, sets), progress=False)
                if attacked:
                    prep.federation.algorithm.__class__ = Boosted
                run_dir = Path(tempfile.mkdtemp(prefix="rel-"))
                try:
                    from rafl.federation.engine import Engine

                    summary = Engine(prep.federation, prep.engine_config, run_dir, progress=False).run()
                    row["attacked" if attacked else "honest"] = {
                        "acc": summary["final"].get("model.acc_mean_over_clients"),
                        "failed_rounds": summary["failed_rounds"], "rejected": summary["rejected_uploads"]}
                except Exception as err:  # noqa: BLE001 - recorded: a run error is a finding
                    row["attacked" if attacked else "honest"] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
                finally:
                    shutil.rmtree(run_dir, ignore_errors=True)
            out.setdefault(method, {})[rule] = row
            print(f"{rounds} rounds, {method}, {rule}: {row}", flush=True)
    return out


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_growth(fn) -> tuple[float, float]:
    """``(seconds, MB)``: how long ``fn()`` ran and how far the resident set grew above its start
    while it ran (sampled every 2 ms from /proc/self/statm by a thread)."""
    import threading

    start, peak, done = rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)

    th = threading.Thread(target=sample)
    th.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        th.join()
    return seconds, max(0.0, max(peak[0], rss_mb()) - start)


def big_rejections(supernet: Path) -> dict:
    """Resident-set growth while screening a 400 MB extra tensor and a 200 MB metadata string, and
    while serializing them (:meth:`Payload.nbytes`, what the engine did before validating)."""
    from rafl.federation.payload import Payload

    fed, state, server, honest, policy = honest_round("fedavg", supernet)
    out = {}
    for name, make in (("extra 400 MB tensor", lambda u: Payload({**u.tensors, "junk": torch.zeros(100_000_000)},
                                                                  dict(u.meta))),
                       ("200 MB metadata string", lambda u: Payload(dict(u.tensors), {**u.meta, "s": "x" * 200_000_000}))):
        bad = make(honest[1][1])
        res = {}
        seconds, grown = peak_rss_growth(lambda: res.update(
            r=screen(fed, state, policy, [(0, copy_upload(honest[0][1])), (1, bad)])))
        try:
            old_s, old_grown = peak_rss_growth(bad.nbytes)
            old = f"{old_grown:.0f} MB in {old_s:.2f} s"
        except Exception as err:  # noqa: BLE001 - e.g. safetensors' "header too large"
            old = f"{type(err).__name__}: {str(err)[:80]}"
        out[name] = {"rejected": 1 in res["r"].rejected, "seconds": seconds, "rss_growth_mb": grown,
                     "serializing_first": old}
        bad = res = None  # free the 400 MB before the next case
    out.update(wire_rejections(fed, state, policy, honest))
    return out


def wire_rejections(fed, state, policy, honest) -> dict:
    """Resident-set growth of the receiving side (worker processes' and Flower's path) while it
    refuses: a 400 MB upload blob (the byte limit, before parsing), a blob whose header says
    200 MB of metadata follow, a payload holding a 200 MB metadata string handed to the worker's
    encoder (refused before serializing), and metadata of a type the wire format refuses."""
    import json as _json

    from safetensors.torch import save as st_save

    from rafl.federation.payload import Payload
    from rafl.federation.screening import RejectedUpload
    from rafl.federation.workers import decode_upload, encode_upload

    limit = policy.byte_limit(fed.algorithm.upload_spec(state, fed.clients[1]))
    out = {}
    blob = Payload({**honest[1][1].tensors, "junk": torch.zeros(100_000_000)}, dict(honest[1][1].meta)).to_bytes()
    res = {}
    seconds, grown = peak_rss_growth(lambda: res.update(r=decode_upload(blob, "client 1", limit)))
    out["400 MB upload blob, received (workers / Flower)"] = {
        "rejected": isinstance(res["r"], RejectedUpload), "seconds": seconds, "rss_growth_mb": grown,
        "serializing_first": f"blob of {len(blob) / 1e6:.0f} MB already received"}
    blob = None
    head = b'{"__metadata__": {"rafl": "' + b"x" * 200_000_000 + b'"}}'
    blob = len(head).to_bytes(8, "little") + head
    head = None
    seconds, grown = peak_rss_growth(lambda: res.update(r=decode_upload(blob, "client 1", None)))
    out["200 MB metadata header, no byte limit"] = {
        "rejected": isinstance(res["r"], RejectedUpload), "seconds": seconds, "rss_growth_mb": grown,
        "serializing_first": (res["r"].reason[:80] if isinstance(res["r"], RejectedUpload) else "accepted")}
    blob = None
    bad = Payload(dict(honest[1][1].tensors), {**honest[1][1].meta, "s": "x" * 200_000_000})
    seconds, grown = peak_rss_growth(lambda: res.update(r=encode_upload(bad, limit)))
    out["200 MB metadata string, sent by a worker's client"] = {
        "rejected": isinstance(res["r"], RejectedUpload), "seconds": seconds, "rss_growth_mb": grown,
        "serializing_first": "refused before serializing" if isinstance(res["r"], RejectedUpload) else "sent"}
    bad = None
    wire = st_save({"w": torch.zeros(2)}, metadata={"rafl": _json.dumps({"m": {"a": 1}})})
    got = decode_upload(wire, "client 1", limit)
    inproc = copy_upload(honest[1][1])
    inproc.meta["m"] = {"a": 1}
    screened = screen(fed, state, policy, [(0, copy_upload(honest[0][1])), (1, inproc)])
    out["dict metadata (wire-type), received"] = {
        "rejected": isinstance(got, RejectedUpload), "seconds": 0.0, "rss_growth_mb": 0.0,
        "serializing_first": (got.reason[:80] if isinstance(got, RejectedUpload) else "accepted")}
    out["dict metadata (wire-type), in-process"] = {
        "rejected": 1 in screened.rejected, "seconds": 0.0, "rss_growth_mb": 0.0,
        "serializing_first": screened.rejected.get(1, "accepted").split(": ", 1)[-1][:80]}
    return out


# ---------------------------------------------------------------------- 2. fuzzed loaders
def fuzz_one(cfg, given, fz, strategy, call) -> tuple[dict, dict]:
    """Run ``call`` on ``cfg.max_examples`` draws of ``strategy``: outcome counts and the slowest."""
    tally = {"parsed": 0, "rejected": 0, "other": 0}
    worst = {"seconds": 0.0, "others": []}

    @cfg
    @given(strategy)
    def one(x):
        t0 = time.perf_counter()
        try:
            tally[fz._guarded(call, x)] += 1
        except Exception as err:  # noqa: BLE001 - counted: a crash, hang or memory blow-up
            tally["other"] += 1
            worst["others"].append(f"{type(err).__name__}: {str(err)[:120]}")
        worst["seconds"] = max(worst["seconds"], time.perf_counter() - t0)

    one()
    return tally, worst


def fuzz(examples: int) -> dict:
    spec = importlib.util.spec_from_file_location("fuzz_loaders", REPO / "tests" / "test_fuzz_loaders.py")
    fz = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "tests"))
    spec.loader.exec_module(fz)
    from hypothesis import given, settings

    cfg = settings(fz.FUZZ, max_examples=examples)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = fz.loader_cases(folder / "seeds")
        payload, state = fz.blob_seeds()
        from rafl.federation.payload import Payload
        from rafl.federation.store import load_state

        runs = {name: (fz.mutated(seed, obj, dump), lambda text, n=name, fn=fname, ld=load:
                       ld(fz._write(folder / "seeds", fn, text)))
                for name, (seed, obj, dump, fname, load) in cases.items()}
        runs["payload_blob"] = (fz.mutated_blob(payload), lambda b: Payload.from_bytes(b, "client 1"))
        runs["client_state_blob"] = (fz.mutated_blob(state), lambda b: load_state(fz._write(folder, "s.st", b)))
        for name, (strategy, call) in runs.items():
            tally, worst = fuzz_one(cfg, given, fz, strategy, call)
            out[name] = {**tally, "slowest_s": worst["seconds"], "others": worst["others"][:5]}
            print(f"fuzz {name}: {tally} slowest {worst['seconds']:.2f} s", flush=True)
    return out


# ---------------------------------------------------------------------- 3. kill -9
KILL_SETS = ["data.limit_per_class=10", "clients.n=3", "algorithm.name=fedgh", "clients.models=cnn4-small",
             "clients.feature_dim=8", "engine.rounds=4", "algorithm.local_epochs=3"]


def federate(out: Path, name: str, resume: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rafl", "federate", "--no-progress"]
    cmd += ["--resume", str(resume)] if resume else ["--out", str(out), *[a for s in [*KILL_SETS, f"name={name}"]
                                                                           for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith("time")}
            for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_when(proc: subprocess.Popen, cond, timeout: float = 900) -> bool:
    """SIGKILL ``proc`` as soon as ``cond()`` holds; False if it ended first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return False
        if cond():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.02)
    proc.kill()
    return False


def kill_cases() -> list[dict]:
    out_cases = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs"
        ref = federate(out, "ref")
        ref.communicate()
        reference = rows(out / "ref")
        run_dir = out / "k"

        def n_rows():
            p = run_dir / "metrics.jsonl"
            return len(p.read_text().splitlines()) if p.is_file() else 0

        def tmp_files():
            return sorted(p.name for d in (run_dir, run_dir / "clients") if d.is_dir() for p in d.glob(".*.tmp"))

        # a: before the first checkpoint (its config.yaml is written, round 1 in progress)
        killed = kill_when(federate(out, "k"), lambda: (run_dir / "clients.json").is_file())
        left = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
        rerun = federate(out, "k")
        text, _ = rerun.communicate()
        out_cases.append({"case": "kill -9 before the first checkpoint, rerun under the same name", "killed": killed,
                          "left_behind": left, "rerun_exit": rerun.returncode,
                          "warned": "starting it afresh" in text, "same_metrics": rerun.returncode == 0 and
                          rows(run_dir) == reference})
        # b: mid-round 2 of a fresh run, then --resume
        import shutil

        shutil.rmtree(run_dir)
        killed = kill_when(federate(out, "k"), lambda: n_rows() >= 1 and any(
            p.name.endswith(".r00002.st") for p in (run_dir / "clients").glob("*.st")))
        before = n_rows()
        res = federate(out, "k", resume=run_dir)
        # c: kill the resume itself once it has written round 3's first client state
        killed_resume = kill_when(res, lambda: any(p.name.endswith(".r00003.st") for p in (run_dir / "clients").glob("*.st")))
        tmp_before = tmp_files()
        res2 = federate(out, "k", resume=run_dir)
        res2.communicate()
        out_cases.append({"case": "kill -9 mid-round 2, --resume", "killed": killed, "rounds_kept": before,
                          "resume_exit": "killed (case c)" if killed_resume else res.returncode})
        out_cases.append({"case": "kill -9 of that --resume mid-round 3, --resume again", "killed": killed_resume,
                          "tmp_files_before_resume": tmp_before, "tmp_files_after": tmp_files(),
                          "resume_exit": res2.returncode,
                          "same_metrics": res2.returncode == 0 and rows(run_dir) == reference})
    return out_cases


# ---------------------------------------------------------------------- 4. one hostile node
NODE_RULES = ("norm_clip", "mean")


def _engine_run(supernet: Path, method: str, rule: str, attack, rounds: int = 3, extra: tuple = (),
                runner: str = "in-process") -> dict:
    """A tiny run (3 clients) of ``method`` under ``rule`` with ``attack(algo_class) -> class``
    installed, on ``runner`` (``in-process``, ``workers``, ``flower-superlink``: rafl's ClientApp on
    two in-process nodes with a SuperLink's semantics, ``flower-simulation``: Flower's Simulation
    Runtime). Returns its outcome: completed, error, failed rounds, rejections, final accuracy and
    whether the final global model outputs finite logits on the server's public images."""
    import shutil

    from rafl.federation.algorithms import ALGORITHMS
    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    sets = [f"supernet.path={supernet}", "data.limit_per_class=10", "clients.n=3", f"engine.rounds={rounds}",
            f"engine.eval_every={rounds}", f"engine.aggregation={rule}", "engine.workers=1",
            f"algorithm.name={method}", "algorithm.local_epochs=1", "engine.round_timeout_s=600", *SAME_MODEL, *extra]
    if runner == "workers":
        sets[6] = "engine.workers=2"
    base = ALGORITHMS[method]
    hostile = attack(base)
    run_dir = Path(tempfile.mkdtemp(prefix="rel-node-"))
    t0 = time.perf_counter()
    ALGORITHMS[method] = hostile  # the nodes build their federation from the registry
    base_update = base.client_update
    try:
        if runner == "flower-simulation":  # Ray's workers are other processes: the attack is the method itself
            base.client_update = hostile.client_update
        prep = federate.prepare(load_run_config(None, sets), progress=False)
        prep.federation.algorithm.__class__ = hostile
        if runner.startswith("flower"):
            import dataclasses

            from rafl.stages.flower import app as flower_app

            cfg = prep.cfg.model_copy(update={"engine": prep.cfg.engine.model_copy(update={"backend": "flower"})})
            prep = dataclasses.replace(prep, cfg=cfg)
            if runner == "flower-superlink":
                from flwr.supercore.task_identity import TaskIdentity  # as Flower's runtimes stamp messages

                TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 0
                sys.path.insert(0, str(REPO / "tests"))
                from test_flower import DirectGrid  # noqa: E402 - rafl's ClientApp on in-process nodes

                from rafl.stages.flower.node import own_node_config

                grid = DirectGrid(2)
                trust = own_node_config(prep.cfg, run_dir / "clients")  # the inputs the run names, its own disk
                for ctx in grid.contexts.values():
                    ctx.node_config.update({"data-roots": trust["data-roots"], "state-dir": str(run_dir / "nodes")})
                summary = flower_app.run_on_grid(grid, prep, run_dir, progress=False)
            else:
                from rafl.stages.flower.simulation import simulate

                summary = simulate(prep, run_dir, progress=False)
        else:
            from rafl.federation.engine import Engine
            from rafl.reports.run import RunReport

            summary = Engine(prep.federation, prep.engine_config, run_dir, progress=False,
                             observers=[RunReport(run_dir)]).run()
        out = {"completed": True, "failed_rounds": summary["failed_rounds"], "rejected": summary["rejected_uploads"],
               "acc": summary["final"].get("model.acc_mean_over_clients")}
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").is_file() else []
        reasons = [why for r in rows for why in r.get("rejected_reasons", {}).values()]
        out["reason"] = reasons[0][:150] if reasons else (summary.get("failed_round_reasons") or [""])[0][:150]
        from rafl.federation.store import load_state

        ck = load_state(run_dir / "checkpoint.safetensors")
        model = prep.federation.client_model(0)
        model.load_state_dict({k: v for k, v in ck["broadcast_tensors"].items()}, strict=False)
        model.eval()
        with torch.no_grad():
            logits = model(prep.federation.server.public_images[:400])
        out["finite_outputs"] = f"{int(torch.isfinite(logits).all(1).sum())}/{len(logits)}"
        out["completed_rounds"] = len(rows)
    except Exception as err:  # noqa: BLE001 - recorded: a run error is a finding
        out = {"completed": False, "error": f"{type(err).__name__}: {str(err)[:150]}"}
    finally:
        ALGORITHMS[method] = base
        base.client_update = base_update
        shutil.rmtree(run_dir, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def bn_attack(base):
    class BNAttack(base):  # client 1 sets one BN running variance to -1e5 in every upload
        def client_update(self, state, broadcast, client):
            state, up = super().client_update(state, broadcast, client)
            if client.client_id == 1:
                name = next(k for k in up.tensors if k.endswith("running_var"))
                up.tensors[name] = up.tensors[name].clone()
                up.tensors[name][0] = -1e5
            return state, up
    BNAttack.__name__ = base.__name__
    return BNAttack


def client_error(base):
    class ClientRaises(base):  # client 1's step raises a rafl error in every round
        def client_update(self, state, broadcast, client):
            if client.client_id == 1:
                from rafl.errors import UserInputError

                raise UserInputError("local training diverged (loss nan)", field="algorithm.lr")
            return super().client_update(state, broadcast, client)
    ClientRaises.__name__ = base.__name__
    return ClientRaises


def lone_upload(supernet: Path) -> dict:
    """Round 1 of FedAvg with all 3 clients honest (it records the carried bound), then round 2
    with client 1 alone, its update x100 (in range, BN statistics left honest): how far its lone
    upload moves the global model (L2 norm of the change) over the carried bound, per rule."""
    from rafl.federation.aggregation import AggregationRule, ClipBounds, update_norms

    fed, state, server, honest, policy = honest_round("fedavg", supernet)
    algo = fed.algorithm
    out = {}
    for rule in NODE_RULES:
        server.aggregation = AggregationRule(rule)
        server.clip_bounds = ClipBounds()
        s1, b1 = algo.server_aggregate(screen(fed, state, policy, [(c, copy_upload(u)) for c, u in honest]).accepted,
                                      state, server)
        carried = server.clip_bounds.carried("weights")
        g = b1.tensors
        up = copy_upload(honest[1][1])
        up.tensors = {k: g[k] + 100 * (v - g[k]) if v.is_floating_point() and "running" not in k else v
                      for k, v in up.tensors.items()}
        accepted = screen(fed, s1, policy, [(1, up)]).accepted
        server.round = 2
        _, b2 = algo.server_aggregate(accepted, s1, server)
        floats = {k: v for k, v in g.items() if v.is_floating_point()}
        moved = update_norms([b2.tensors], floats)[0]
        honest_moved = update_norms([honest[1][1].tensors], floats)[0]
        out[rule] = {"moved": moved, "carried_bound": carried, "ratio": moved / carried if carried else None,
                     "honest_update_norm": honest_moved}
        print(f"lone upload, {rule}: {out[rule]}", flush=True)
    server.clip_bounds = None
    return out


def background_sigint() -> dict:
    """``rafl federate`` started with SIGINT ignored (as ``rafl federate ... &`` from a shell), sent
    SIGINT once its round 1 began: its exit status and the seconds it took to end."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rafl", "federate", "--no-progress", "--out", str(Path(tmp) / "runs"),
               *[a for s in [*KILL_SETS, "engine.rounds=200", "name=bg"] for a in ("--set", s)]]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        deadline = time.time() + 300
        while not (Path(tmp) / "runs" / "bg" / "clients.json").is_file() and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.05)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
            out = {"exit": proc.returncode, "seconds": time.perf_counter() - t0}
        except subprocess.TimeoutExpired:
            proc.kill()
            out = {"exit": "still running after 60 s (killed)", "seconds": 60.0}
    print(f"background SIGINT: {out}", flush=True)
    return out


def hostile_node(supernet: Path, backends: list[str]) -> dict:
    out: dict = {"bn_variance": {}, "client_error": {}}
    for rule in NODE_RULES:
        out["bn_variance"][rule] = _engine_run(supernet, "fedavg", rule, bn_attack)
        print(f"BN variance -1e5, {rule}: {out['bn_variance'][rule]}", flush=True)
    out["lone_upload"] = lone_upload(supernet)
    for backend in backends:
        out["client_error"][backend] = {}
        for rule in NODE_RULES:
            out["client_error"][backend][rule] = _engine_run(supernet, "fedavg", rule, client_error, runner=backend)
            print(f"client error, {backend}, {rule}: {out['client_error'][backend][rule]}", flush=True)
    out["background_sigint"] = background_sigint()
    return out


def node_report(n: dict) -> list[str]:
    def cell(r):
        if not r.get("completed"):
            return f"run ended: {r.get('error', '')[:80]}"
        acc = "n/a" if r["acc"] is None else f"{r['acc']:.3g}"
        return (f"completed, {r['failed_rounds']} failed / {r['rejected']} rejected, acc {acc}, finite outputs "
                f"{r['finite_outputs']}")
    lines = ["", "## One hostile node: BN statistics, a lone upload, a client's error, background SIGINT", "",
             f"`{n.get('command', '')}`, {n.get('date', '')} ({n.get('wall_s', 0):.0f} s). "
             "FedAvg, one shared arch, 3 clients (client 1 hostile), 3 rounds; the default rule `norm_clip` beside "
             "`mean`. Finite outputs: the final global model's logits on the server pool's images (at most 400).", "",
             "| case | " + " | ".join(NODE_RULES) + " |", "|---|" + "---|" * len(NODE_RULES),
             "| BN running variance -1e5 every round | " + " | ".join(cell(n["bn_variance"][r]) for r in NODE_RULES)
             + " |"]
    lone = n["lone_upload"]
    bound = lone["norm_clip"]["carried_bound"]
    lines.append("| lone upload x100 (round 2, alone after an honest round of 3): L2 move of the global model / the "
                 "bound carried from round 1 | " + " | ".join(f"{lone[r]['moved'] / bound:.3g} ({lone[r]['moved']:.3g} "
                                                              f"/ {bound:.3g})" for r in NODE_RULES) + " |")
    for backend, rows_ in n["client_error"].items():
        lines.append(f"| client 1's step raises a UserInputError every round, {backend} | "
                     + " | ".join(cell(rows_[r]) for r in NODE_RULES) + " |")
    bg = n["background_sigint"]
    lines.append(f"| `rafl federate` started with SIGINT ignored (a background job), sent SIGINT | exit {bg['exit']} "
                 f"in {bg['seconds']:.1f} s | (no rule involved) |")
    reasons = [("BN variance", n["bn_variance"]["norm_clip"].get("reason", ""))] + \
        [(f"client error, {b}", r["norm_clip"].get("reason", "")) for b, r in n["client_error"].items()]
    lines += ["", "Reasons recorded (`norm_clip`):", ""] + [f"- {k}: `{v}`" for k, v in reasons if v]
    lines += ["", "`flower-superlink`: rafl's ClientApp and ServerApp exchanging Flower messages through an "
              "in-process grid with a SuperLink's semantics (a client's error comes back as the node's record). "
              "Flower's Simulation Runtime runs the ClientApps in Ray's worker processes, which this bench cannot "
              "make hostile; its path (the nodes' records, states on the shared disk) is "
              "`tests/test_flower.py::test_one_clients_error_on_its_node_is_that_clients_failure_as_in_process`."]
    return lines


# ---------------------------------------------------------------------- report
def fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def report(data: dict) -> str:
    lines = ["# Reliability: hostile uploads, hostile files, kill -9", "",
             f"`{data.get('command', 'python bench/reliability.py --fuzz-examples ' + str(data['fuzz_examples']))}` "
             f"on {data['machine']}, "
             f"{data['date']} ({data['wall_s']:.0f} s).", ""]
    hu = data["hostile"]
    names = list(next(iter(hu["table"].values())))
    lines += ["## Hostile uploads per method (round 1, client 1 of 3 hostile)", "",
              "R = rejected (one line naming the client and the reason), H = accepted and harmless (the aggregate "
              "is bit for bit the one of the honest upload), X = accepted and harmful (max |delta| of the aggregate).",
              "", "| attack | " + " | ".join(hu["table"]) + " |", "|---|" + "---|" * len(hu["table"])]
    for n in names:
        cells = []
        for m in hu["table"]:
            r = hu["table"][m].get(n)
            cells.append("-" if r is None else {"rejected": "R", "accepted-harmless": "H"}.get(
                r["outcome"], "X server step failed" if "server_step_error" in r else f"X {fmt(r.get('max_abs_delta'))}"))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    tried = sum(len(v) for v in hu["table"].values())
    first = "fedavg" if "fedavg" in hu["table"] else next(iter(hu["table"]))
    rej = sum(r["outcome"] == "rejected" for v in hu["table"].values() for r in v.values())
    harmless = sum(r["outcome"] == "accepted-harmless" for v in hu["table"].values() for r in v.values())
    lines += ["", f"{tried} hostile uploads tried: {rej} rejected, {harmless} accepted-harmless, "
              f"{tried - rej - harmless} accepted-harmful (the in-range boosted update: a valid-looking model, "
              "which only a robust rule bounds, below).", "", f"Reasons ({first}):", ""]
    for n, r in hu["table"][first].items():
        if r["outcome"] == "rejected":
            lines.append(f"- {n}: `{r['reason']}`")
    if hu.get("influence"):
        lines += ["", "## A boosted (x100) upload's influence, per rule (round 1, leave-one-out)", "",
                  "How far client 1's boosted upload moves the broadcast (max |delta| with and without it) over "
                  "how far the most influential honest client of the same round moves it (the same leave-one-out), "
                  "and in brackets over the most influential client of that round had all three been honest; "
                  "<= 1 meets the target. Default rule: `norm_clip`. With 3 clients, removing one re-clips the "
                  "other two (the lower median of two is the smaller), so values a little above 1 come from "
                  "the measurement, not from the attacker's term, which is at most the largest honest term.", "",
                  "| method | " + " | ".join(RULES) + " |", "|---|" + "---|" * len(RULES)]
        for m, r in hu["influence"].items():
            lines.append(f"| {m} | " + " | ".join(
                f"{fmt(r[k]['same_round'])} ({fmt(r[k]['vs_honest_round'])})" if isinstance(r[k], dict) else fmt(r[k])
                for k in RULES) + " |")
    if data.get("rounds"):
        lines += ["", "## A boosted (x100) client every round, 6 rounds, per rule", "",
                  "In-process engine, 3 clients, client 1 boosted in every round. Cell: rounds failed / uploads "
                  "rejected / final accuracy (mean over clients) with the attacker, then the same rule's run "
                  "without it (tiny digits federation: 10 images per class, accuracies are noisy).", "",
                  "| method | " + " | ".join(RULES) + " |", "|---|" + "---|" * len(RULES)]

        def cell(r):
            a, h = r.get("attacked", {}), r.get("honest", {})
            if "error" in a:
                return f"run error: {a['error'][:60]}"
            return (f"{a['failed_rounds']} / {a['rejected']} / {fmt(a['acc'])} (honest {fmt(h.get('acc'))})")
        for m, r in data["rounds"].items():
            lines.append(f"| {m} | " + " | ".join(cell(r[k]) for k in RULES if k in r) + " |")
    lines += ["", "## A 10^12-sample claim", "",
              "| method | registered n | honest client moves the average (max abs) | the 10^12 claim moves it | "
              "attacker's share under weights from the claim |", "|---|---|---|---|---|"]
    for m in [m for m in ("fedavg", "rafl") if m in hu]:
        c = hu[m]
        lines.append(f"| {m} | {c['registered_n']} | {fmt(c['honest_client_moves'])} | {fmt(c['claim_1e12_moves'])} | "
                     f"{c['old_rule_measured_share']:.6f} (n-weights: {c['old_rule_attacker_share']:.6f}) |")
    lines += ["", "The claim moves the average exactly as far as the honest client does: the weight is the "
              "registered count. Under the old rule (weights from the claim) the attacker's share was ~100%.", "",
              "## A boosted (x100, in range) update per `engine.aggregation`", "",
              "| method | mean | median | trimmed_mean (0.34) | norm_clip (median norm) |", "|---|---|---|---|---|"]
    for m in [m for m in ("fedavg", "rafl") if m in hu]:
        r = hu[m]["boosted_x100_max_delta_by_rule"]
        lines.append(f"| {m} | " + " | ".join(fmt(r[k]) for k in ("mean", "median", "trimmed_mean", "norm_clip")) + " |")
    lines += ["", "Max |delta| of the aggregate against the same rule's honest aggregate (3 clients, 1 hostile).", "",
              "## Oversized uploads: memory", "",
              "| upload | rejected | seconds | RSS growth while screening (MB) | serializing it first (the old order) |",
              "|---|---|---|---|---|"]
    for n, r in hu["memory"].items():
        lines.append(f"| {n} | {r['rejected']} | {r['seconds']:.3f} | {r['rss_growth_mb']:.0f} | "
                     f"{r['serializing_first']} |")
    lines += ["", "The size is counted from the tensors' and strings' lengths, never by serializing."]
    if data.get("fuzz"):
        lines += ["", f"## Fuzzed loaders ({data['fuzz_examples']} examples each, deterministic)", "",
                  "| loader | parsed | rejected (one UserInputError) | other (crash, hang, memory) | slowest (s) |",
                  "|---|---|---|---|---|"]
    for n, r in data.get("fuzz", {}).items():
        lines.append(f"| {n} | {r['parsed']} | {r['rejected']} | {r['other']} | {r['slowest_s']:.2f} |")
        for o in r["others"]:
            lines.append(f"|  | | | `{o}` | |")
    if data.get("hostile_node"):
        lines += node_report(data["hostile_node"])
    if data.get("kill"):
        lines += ["", "## kill -9", "", "FedGH on a cnn4-small group, 3 clients, 4 rounds; the final metrics "
                  "(without timings) compared with an uninterrupted run.", ""]
        for c in data["kill"]:
            lines.append("- " + c["case"] + ": " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "case"))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fuzz-examples", type=int, default=200, help="0: no fuzzing")
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--skip-rounds", action="store_true", help="without the 6-round boosted runs (about 12 minutes)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated (fedavg and rafl are measured)")
    ap.add_argument("--out", default="reliability", help="bench/results/OUT.md and OUT.json (default: %(default)s)")
    ap.add_argument("--only-nodes", action="store_true",
                    help="run only the hostile-node cases (BN statistics, lone upload, client errors per backend, "
                    "background SIGINT) and add them to the existing OUT.json and OUT.md")
    ap.add_argument("--node-backends", default="in-process,workers,flower-superlink",
                    help="comma-separated backends of the client-error case (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.only_nodes:
        os.environ.setdefault("RAFL_CACHE_DIR", tempfile.mkdtemp(prefix="rafl-bench-cache-"))
        path = RESULTS / f"{args.out}.json"
        data = json.loads(path.read_text())
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            data["hostile_node"] = hostile_node(tiny_supernet(Path(tmp) / "supernet"), args.node_backends.split(","))
        data["hostile_node"]["command"] = " ".join(["python", "bench/reliability.py", *sys.argv[1:]])
        data["hostile_node"]["wall_s"] = time.time() - t0
        data["hostile_node"]["date"] = time.strftime("%Y-%m-%d")
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")
        (RESULTS / f"{args.out}.md").write_text(report(data))
        print("\n".join(node_report(data["hostile_node"])))
        return
    os.environ.setdefault("RAFL_CACHE_DIR", tempfile.mkdtemp(prefix="rafl-bench-cache-"))
    t0 = time.time()
    data = {"fuzz_examples": args.fuzz_examples, "command": " ".join(["python", "bench/reliability.py", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}", "date": time.strftime("%Y-%m-%d")}
    def save():  # after every section: a run stopped later keeps what it measured
        data["wall_s"] = time.time() - t0
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (RESULTS / f"{args.out}.md").write_text(report(data))

    with tempfile.TemporaryDirectory() as tmp:
        supernet = tiny_supernet(Path(tmp) / "supernet")
        data["hostile"] = hostile_uploads(supernet, args.methods.split(","))
        save()
        if not args.skip_rounds:
            data["rounds"] = boosted_rounds(supernet, args.methods.split(","))
            save()
    if args.fuzz_examples > 0:
        data["fuzz"] = fuzz(args.fuzz_examples)
        save()
    if not args.skip_kill:
        data["kill"] = kill_cases()
        print(json.dumps(data["kill"], indent=1), flush=True)
        save()
    print(report(data))


if __name__ == "__main__":
    main()
