"""Round speed: every method's rafl rounds against a bare PyTorch loop doing the same work, the
worker processes (``engine.workers`` 1 vs 2, on a quiet machine and beside a CPU hog), and the
peak memory of each.

Scenario (issue 44): a CIFAR-10 subset (``--limit-per-class`` images per class from each of the
train and test sets, pooled, then partitioned), ``--clients`` clients with 2 classes each
(pathological), the FedAvg CNN ``cnn4`` (D = 128), batch 10, 1 local epoch, every client every
round, evaluation of every client every round, ``--rounds`` rounds, one torch thread per process,
each method with rafl's default hyperparameters.

The bare loops (:func:`run_bare`): for every client, one after another, a model kept in memory, SGD
(the method's lr, momentum and weight decay) over its train split in shuffled batches of 10 (a
trailing 1-sample batch merged, as rafl does) with the method's loss, then the server step, then
every client's accuracy on its test split -- nothing of rafl's engine: no state files, payloads,
screening, checkpoints, metrics files or plots. Prototypes and logits are collected the way
HtFLlib (TsingZ0/HtFLlib, ``system/flcore/clients``) collects them: FedProto and FD from the
training pass itself (``clientproto.train`` / ``clientdistill.train`` append every batch's
train-mode representations / logits), FedTGP and FedGH with an extra eval-mode pass over the
train split after training (``clienttgp.collect_protos`` / ``clientgh.collect_protos``). Per
method:

* standalone: cross-entropy;
* fedproto: + lambda * MSE(f(x), global prototype of y); server: count-weighted class means;
* fd: + gamma * MSE(logits, global mean logits of y); server: equal-weight class means;
* fedtgp: + lambda * ||f(x) - P_y||; server: the trainable prototypes (embedding + 2 layers),
  ``server_epochs`` epochs of the margin-contrastive loss on the uploads, batch 32;
* fedgh: cross-entropy under the global header; server: one SGD step per uploaded class mean
  (gradient norm clipped); evaluation: the global and the local header on one features pass;
* lg-fedavg: cross-entropy under the global header; server: sample-weighted header average;
* rafl: deep mutual learning of the client's model and the knowledge network (cnn4-small);
  server: sample-weighted average of the knowledge networks; evaluation: both models.

A bare loop imports torch and ``rafl.models`` (the model builder) only, and reads the images,
labels and partition that rafl loaded, from a file the parent writes once (uint8 pixels
normalized per batch, like rafl's loader).

``--methods`` may name a method with its ``class_means`` (``fedproto@last_epoch``: rafl collects
the prototypes in the training pass, as the bare loop does; plain ``fedproto`` is rafl's default,
one more eval-mode pass).

Each variant runs in its own process (``--variant``), back to back: per method the bare loop and
rafl at ``engine.workers: 1``, in alternating order over ``--repeats``; medians. The parent
samples the memory of the variant's process tree every 0.05 s: peak RSS (shared pages counted in
every process) and peak PSS (proportional set size: pages shared by forked workers counted once).
Times exclude loading the data (the same for every variant); rafl's include everything
``federate.run`` does (state files, checkpoints, metrics files, the two plots at the end).

Workers (``--workers-method``, default fedproto): rafl at ``engine.workers`` 1 and 2, alternating,
with the machine as it is, then again beside a CPU hog (``--hog``: one process per core minus one
spinning at the same niceness). Memory (``--memory-limit``): the same method on a larger subset
(default the whole CIFAR-10, 60,000 images) for 1 round, bare loop vs rafl workers 1 and 2: peak
RSS / PSS only (the clients trained differ in number: rafl samples ``--memory-per-round``).

Cross-device (``--scenario crossdevice``, issue 60): 50 clients of about 90 CIFAR-10 training
images each, every client every round -- the 35,000 images outside the shipped ``cifar10``
supernet's server pool (``public_fraction`` 0.5), Dirichlet alpha 0.5 over the clients, each
client's images split 0.13 / 0.84 / 0.03 (train / val, never read / test) -- the clients on the
pi4 / jetson-nano / phone picks of ``rafl search --supernet cifar10`` (docs/search.md) round-robin
(``uniform``: the pi4 pick for every client), one local epoch, batch 32, ``engine.workers: 1``.
Methods standalone, uniform, heterofl, fedproto, fedtgp, fedgh, rafl. The bare loops are the ones
above on copies of the same nn.Modules rafl trains (the parent writes rafl's BN-recalibrated tier
subnets and RaFL's knowledge network into the data file); for ``uniform`` FedAvg's server step, for
``heterofl`` a FedAvg per tier subnet (the same client arithmetic; a cheaper server step than
HeteroFL's masked average into the supernet). Both variants warm every distinct model up (two SGD
steps, one eval forward) before the timer; the figures are img/s of the last round without its
evaluation. Writes ``bench/results/round_speed_crossdevice.md`` and ``.json``; one round per
variant and one repeat by default (about 12 minutes on 2 busy cores).

Run: ``nice -n 10 python bench/round_speed.py`` (about 5-10 minutes on 2 cores); writes
``bench/results/round_speed.md`` and ``.json``. ``--big-clients 3000`` adds the 3,000-client
evaluation round of issue 35 (``round_speed_eval.md``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = Path.home() / ".cache" / "rafl-data" / "cifar10"
TARBALL = ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"
METHODS = ["standalone", "fedproto", "fedtgp", "fd", "fedgh", "lg-fedavg", "rafl"]
#: the cross-device workload: the shipped cifar10 supernet's subnets of `rafl search --supernet cifar10`
#: for the three shipped profiles (docs/search.md), fixed so no search runs
XD_ARCHS = {
    "pi4": "r28_k7e6.k3e6.k7e4.k5e3|k5e6.k7e6.k7e4.k5e6|k7e6.k5e4.k7e3|k5e4.k3e3|k7e3.k5e3",
    "jetson-nano": "r32_k5e6.k7e6.k7e6|k7e6.k7e6.k5e6.k5e6|k7e6.k7e4.k7e3|k5e6.k3e6|k7e6.k7e6",
    "phone": "r28_k7e6.k7e6.k7e6.k7e6|k7e6.k7e6.k7e6.k7e6|k7e6.k7e4.k5e6.k7e6|k7e6.k3e6.k7e6.k7e6|"
             "k7e6.k7e6.k7e6.k7e6",
}
XD_METHODS = ["standalone", "uniform", "heterofl", "fedproto", "fedtgp", "fedgh", "rafl"]
FEDAVG_FAMILY = ("uniform", "heterofl")
#: per-client (train, val, test) shares: the 35,000 non-pool CIFAR-10 images over 50 clients give
#: about 90 training images each; val is never read; ~20 test images each
XD_SPLIT = (0.13, 0.84, 0.03)


def overrides(args, method: str, clients: int, limit: int | None, workers: int, rounds: int,
              per_round: int | None = None) -> list[str]:
    if args.scenario == "crossdevice":
        return crossdevice_overrides(args, method, clients, workers, rounds)
    method, _, means = method.partition("@")  # fedproto@last_epoch: the method with class_means set
    out = [f"algorithm.name={method}", *([f"algorithm.class_means={means}"] if means else []), "data.dataset=cifar10", f"data.root={args.cifar}",
           "partition.scheme=pathological", "partition.k=2", f"clients.n={clients}", f"clients.models={args.model}",
           "train.batch_size=10", "train.threads=1", "algorithm.local_epochs=1", f"engine.rounds={rounds}",
           f"engine.workers={workers}", f"seed={args.seed}", "engine.target_accuracy=null"]
    if limit is not None:
        out.append(f"data.limit_per_class={limit}")
    if per_round is not None:
        out.append(f"engine.clients_per_round={per_round}")
    return out


def crossdevice_overrides(args, method: str, clients: int, workers: int, rounds: int) -> list[str]:
    """The cross-device workload (module docstring): every client a tier subnet of the shipped
    ``cifar10`` supernet, about ``XD_TRAIN_IMAGES`` training images each, all sampled every round."""
    method, _, means = method.partition("@")
    archs = "{" + ",".join(f"{p}: '{a}'" for p, a in XD_ARCHS.items()) + "}"
    out = [f"algorithm.name={method}", *([f"algorithm.class_means={means}"] if means else []), "data.dataset=cifar10",
           f"data.root={args.cifar}", "supernet=cifar10", "partition.scheme=dirichlet", f"partition.alpha={args.alpha}",
           "partition.public_fraction=0.5", "partition.public_seed=0", "partition.min_samples=10",
           f"partition.split={list(XD_SPLIT)}", f"clients.n={clients}", "clients.models=nas",
           # uniform: every client on the pi4 pick (the pi4 profile for all: the shipped profiles do not nest)
           "clients.profiles=[pi4]" if method == "uniform" else "clients.profiles=[pi4, jetson-nano, phone]",
           f"clients.archs={archs}",
           f"train.batch_size={args.batch_size}", "train.threads=1", "algorithm.local_epochs=1",
           f"engine.rounds={rounds}", f"engine.workers={workers}", f"seed={args.seed}", "engine.target_accuracy=null"]
    return out


def _warm_up(models) -> None:
    """Two SGD steps and one eval-mode forward of a throwaway copy of every model on random batches
    of 32: the process's one-time costs (allocator, oneDNN primitives per shape) before the timer,
    the same in the bare loop and in rafl."""
    import copy

    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    for m in models:
        m = copy.deepcopy(m).train()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        for _ in range(2):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            m.eval()(x)


# ---------------------------------------------------------------------- variants (child processes)
def run_rafl(args) -> dict:
    import torch

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    torch.set_num_threads(1)
    per_round = args.per_round or None
    cfg = load_run_config(None, overrides(args, args.method, args.clients, args.limit_per_class, args.workers,
                                          args.rounds, per_round))
    prep = federate.prepare(cfg, progress=False)
    if args.scenario == "crossdevice":  # every tier's model built (BN-recalibrated once) and warmed up
        fed = prep.federation
        firsts = {c.model_key: c.client_id for c in fed.clients}
        models = [fed.client_model(cid) for cid in firsts.values()]
        if args.method == "rafl":
            from rafl.supernet.model import narrow_width

            models.append(narrow_width(fed.server.make_model(fed.server.space.smallest()), 0.375))
        _warm_up(models)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        summary = federate.run(prep, Path(d) / "run", progress=False)
        wall = time.perf_counter() - t0
        hist = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "rounds_s": sum(r["time_s"] for r in hist),
            "client_update_s": sum(r["time_client_update_s"] for r in hist),
            "evaluate_s": sum(r["time_evaluate_s"] for r in hist), "engine_s": sum(r["time_engine_s"] for r in hist),
            "rounds": [{"round_s": r["time_s"], "client_update_s": r["time_client_update_s"],
                        "aggregate_s": r["time_aggregate_s"], "evaluate_s": r["time_evaluate_s"],
                        "engine_s": r["time_engine_s"]} for r in hist],
            "final": {k: v for k, v in summary["final"].items() if k.endswith("acc_mean_over_clients")}}




def _batches(pix, a, b, labels, idx, bs: int, gen=None):
    """Batches of ``idx`` (shuffled with ``gen``), a trailing 1-sample batch merged into the one before."""
    import torch

    order = idx[torch.randperm(len(idx), generator=gen)] if gen is not None else idx
    chunks = list(order.split(bs))
    if len(chunks) > 1 and len(chunks[-1]) == 1:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    for c in chunks:
        yield pix[c].float().mul_(a).add_(b), labels[c]


def _bare_server(st, rnd, uploads, kn_states) -> None:
    """The server step of the bare loop of ``st.method`` (module docstring); updates ``st`` in place."""
    import torch
    import torch.nn.functional as F

    method, hp, K, D, glob, head, tgp, know, models = (st.method, st.hp, st.K, st.D, st.glob, st.head, st.tgp,
                                                        st.know, st.models)
    local_heads = st.local_heads
    if method == "fedproto":  # count-weighted mean per class (Eq. 6)
        tot_s, tot_n = torch.zeros(K, D), torch.zeros(K)
        for cls, v, c in uploads:
            tot_s.index_add_(0, cls, v * c[:, None])
            tot_n.index_add_(0, cls, c)
        glob.update({k: tot_s[k] / tot_n[k] for k in range(K) if tot_n[k] > 0})
    elif method == "fd":  # equal-weight mean per class
        tot_s, tot_n = torch.zeros(K, K), torch.zeros(K)
        for cls, v, _ in uploads:
            tot_s.index_add_(0, cls, v)
            tot_n.index_add_(0, cls, torch.ones(len(cls)))
        glob.update({k: tot_s[k] / tot_n[k] for k in range(K) if tot_n[k] > 0})
    elif method == "fedtgp":  # trainable prototypes, margin-enhanced contrastive loss
        x_p = torch.cat([v for _, v, _ in uploads])
        y_p = torch.cat([cls for cls, _, _ in uploads])
        means = torch.stack([x_p[y_p == k].mean(0) for k in y_p.unique()])
        margin = min(float(torch.cdist(means, means).masked_fill(torch.eye(len(means), dtype=torch.bool),
                                                                    float("inf")).min()), float(hp["tau"]))
        opt_s = torch.optim.SGD(tgp.parameters(), lr=hp["server_lr"])
        g = torch.Generator().manual_seed(rnd)
        all_k = torch.arange(K)
        for _ in range(int(hp["server_epochs"])):
            order = torch.randperm(len(y_p), generator=g)
            for i in range(0, len(y_p), int(hp["server_batch_size"])):
                j = order[i:i + int(hp["server_batch_size"])]
                gp = tgp["net"](tgp["emb"](all_k))
                dist = torch.cdist(x_p[j], gp) + margin * F.one_hot(y_p[j], K)
                loss = F.cross_entropy(-dist, y_p[j])
                opt_s.zero_grad()
                loss.backward()
                opt_s.step()
        with torch.no_grad():
            seen = sorted(set(glob) | set(y_p.tolist()))
            gp = tgp["net"](tgp["emb"](torch.tensor(seen)))
            glob = {k: gp[i] for i, k in enumerate(seen)}
    elif method == "fedgh":  # global header: one SGD step per LAR, clients in order
        hdr = copy.deepcopy(models[0].head).train()  # cnn4: a Linear(D, K); a subnet: dropout + linear
        hdr.load_state_dict(head)
        opt_s = torch.optim.SGD(hdr.parameters(), lr=hp["server_lr"])
        for cls, v, _ in uploads:
            for i in range(len(cls)):
                loss = F.cross_entropy(hdr(v[i:i + 1]), cls[i:i + 1])
                opt_s.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(hdr.parameters(), hp["server_max_grad_norm"])
                opt_s.step()
        local_heads = [{k: v.detach().clone() for k, v in m.head.state_dict().items()} for m in models]
        head = {k: v.detach().clone() for k, v in hdr.state_dict().items()}
    elif method == "lg-fedavg":
        tot = sum(w for _, w in uploads)
        head = {k: sum(s[k] * (w / tot) for s, w in uploads) for k in uploads[0][0]}
    elif method == "rafl":
        tot = sum(w for _, w in kn_states)
        know.load_state_dict({k: sum(s[k] * (w / tot) for s, w in kn_states) for k in kn_states[0][0]})
    st.glob, st.head, st.local_heads = glob, head, local_heads


def _fedavg_server(fedavg: dict, uploads: list, models: list, arch_of: list[str]) -> None:
    """FedAvg per arch: the sample-weighted average of the uploads of each arch (float tensors; BN's
    batch counters from the first upload), loaded into every client model of that arch."""
    for key in fedavg:
        ups = [(s, w) for a, s, w in uploads if a == key]
        if ups:
            tot = sum(w for _, w in ups)
            fedavg[key] = {k: (sum(s[k] * (w / tot) for s, w in ups) if v.is_floating_point() else v)
                           for k, v in ups[0][0].items()}
    for cid, m in enumerate(models):
        m.load_state_dict(fedavg[arch_of[cid]])


def _bare_models(args, d, method: str, n: int):
    """``(client models, knowledge network or None, arch key of every client or None, FedAvg global
    states per arch or None)``: cnn4 members built from scratch, or the cross-device tier subnets."""
    from rafl.models import KNOWLEDGE_MODEL, make_member

    K, D = d["n_classes"], d["feature_dim"]
    if "tiers" not in d:
        models = [make_member(args.model, K, D, 3, 32) for _ in range(n)]
        return models, make_member(KNOWLEDGE_MODEL, K, D, 3, 32) if method == "rafl" else None, None, None
    arch_of = d["arch_of"] if method != "uniform" else [d["uniform"]] * n
    models = [copy.deepcopy(d["tiers"][arch_of[cid]]) for cid in range(n)]
    know = copy.deepcopy(d["knowledge"]) if method == "rafl" else None
    fedavg = None
    if method in FEDAVG_FAMILY:  # one global state per arch
        fedavg = {}
        for cid, m in enumerate(models):
            fedavg.setdefault(arch_of[cid], {k: v.detach().clone() for k, v in m.state_dict().items()})
    return models, know, arch_of, fedavg


def _bare_evaluate(st, d, n) -> dict[str, list[float]]:
    """Every client's accuracies on its test split, per inference rule."""
    import torch

    method, K, glob, head, local_heads = st.method, st.K, st.glob, st.head, st.local_heads
    pix, a, b, labels, bs, models, know = d["pixels"], d["a"], d["b"], d["labels"], d["batch_size"], st.models, st.know
    res: dict[str, list[float]] = {}
    if glob and method in ("fedproto", "fedtgp"):
        keys = torch.tensor(sorted(glob))
        bank = torch.stack([glob[k] for k in sorted(glob)])
    for cid in range(n):
        model = models[cid].eval()
        if head is not None:
            model.head.load_state_dict(head)
        counts_eval: dict[str, int] = {}
        total = 0
        with torch.no_grad():
            if method == "fedgh":
                loc = copy.deepcopy(model.head).eval()
                loc.load_state_dict(local_heads[cid])
            for x, y in _batches(pix, a, b, labels, d["test"][cid], bs):
                feats = model.features(x)
                outs = {"model": model.head(feats)}
                if glob and method in ("fedproto", "fedtgp"):
                    outs["proto"] = keys[torch.cdist(feats, bank).argmin(1)][:, None].eq(torch.arange(K)).float()
                if method == "fedgh":
                    outs["local"] = loc(feats)
                if method == "rafl":
                    outs["knowledge"] = know.eval()(x)
                for k, z in outs.items():
                    counts_eval[k] = counts_eval.get(k, 0) + int((z.argmax(1) == y).sum())
                total += len(y)
        for k, c in counts_eval.items():
            res.setdefault(k, []).append(c / max(total, 1))
    return res


def run_bare(args) -> dict:
    """The method's rounds as a plain PyTorch loop (module docstring, "The bare loops")."""
    import torch
    import torch.nn.functional as F

    from rafl.models import KNOWLEDGE_MODEL, make_member

    torch.set_num_threads(1)
    d = torch.load(args.data, weights_only=False)
    method = args.method.partition("@")[0]  # the bare loop collects class means as HtFLlib does, whatever rafl's
    pix, labels, hp = d["pixels"], d["labels"], d["hparams"][method]
    a, b = d["a"], d["b"]
    K, D, bs = d["n_classes"], d["feature_dim"], d["batch_size"]
    n = min(len(d["train"]), args.bare_clients or len(d["train"]))
    xd = "tiers" in d  # the cross-device workload: the parent's tier subnets, copied per client
    if xd:
        _warm_up([*d["tiers"].values(), *([d["knowledge"]] if method == "rafl" else [])])
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    # FedAvg family (uniform: one subnet for all; heterofl: here a FedAvg per tier subnet, a cheaper
    # server step than HeteroFL's masked average into the supernet): a global state per arch
    models, know, arch_of, fedavg = _bare_models(args, d, method, n)
    head = {k: v.clone() for k, v in models[0].head.state_dict().items()} if method in ("fedgh", "lg-fedavg") else None
    tgp = None
    if method == "fedtgp":
        hid = int(hp["server_hidden_dim"]) or D
        tgp = torch.nn.ModuleDict({"emb": torch.nn.Embedding(K, D),
                                   "net": torch.nn.Sequential(torch.nn.Linear(D, hid), torch.nn.ReLU(), torch.nn.Linear(hid, D))})
    glob: dict[int, torch.Tensor] = {}  # global prototypes / logits by class
    st = types.SimpleNamespace(method=method, hp=hp, K=K, D=D, glob=glob, head=head, tgp=tgp, know=know, models=models,
                               local_heads=None)
    rounds_t: list[dict] = []

    def sgd(params):
        return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])

    def reg_term(feats, logits, y):
        if method not in ("fedproto", "fedtgp", "fd") or not glob:
            return 0.0
        bank = torch.zeros(K, (logits if method == "fd" else feats).shape[1])
        has = torch.zeros(K, dtype=torch.bool)
        for k, v in glob.items():
            bank[k], has[k] = v, True
        m = has[y]
        if method == "fedproto":
            return hp["lambda"] * (feats[m] - bank[y][m]).pow(2).mean(-1).sum() / len(y)
        if method == "fd":
            return hp["gamma"] * (logits[m] - bank[y][m]).pow(2).mean(-1).sum() / len(y)
        diff = feats[m] - bank[y][m]  # fedtgp: Euclidean distance
        return hp["lambda"] * diff.pow(2).sum(-1).clamp_min(1e-12).sqrt().sum() / len(y)

    acc: dict[str, float] = {}
    for rnd in range(1, args.rounds + 1):
        t_round = time.perf_counter()
        uploads = []
        kn_states = []
        for cid in range(n):
            model = models[cid].train()
            if head is not None:
                model.head.load_state_dict(head)
            if fedavg is not None:
                model.load_state_dict(fedavg[arch_of[cid]])
            opt = sgd(model.parameters())
            if know is not None:
                k_model = copy.deepcopy(know) if xd else make_member(KNOWLEDGE_MODEL, K, D, 3, 32)
                k_model.load_state_dict(know.state_dict())
                k_model.train()
                k_opt = sgd(k_model.parameters())
            width = K if method == "fd" else D
            sums, counts = torch.zeros(K, width), torch.zeros(K)
            gen = torch.Generator().manual_seed(rnd * 1000 + cid)
            for _ in range(int(hp["local_epochs"])):
                for x, y in _batches(pix, a, b, labels, d["train"][cid], bs, gen):
                    feats = model.features(x)
                    logits = model.head(feats)
                    loss = F.cross_entropy(logits, y)
                    if know is not None:  # deep mutual learning (T = 1)
                        zk = k_model(x)
                        loss_k = F.cross_entropy(zk, y) + hp["alpha"] * F.kl_div(
                            F.log_softmax(zk, 1), F.softmax(logits.detach(), 1), reduction="batchmean")
                        loss = loss + hp["alpha"] * F.kl_div(F.log_softmax(logits, 1), F.softmax(zk.detach(), 1),
                                                             reduction="batchmean")
                        loss = loss + loss_k
                        k_opt.zero_grad(set_to_none=True)
                    loss = loss + reg_term(feats, logits, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    if know is not None:
                        k_opt.step()
                    if method in ("fedproto", "fd"):  # HtFLlib: collected in the training pass
                        sums.index_add_(0, y, (logits if method == "fd" else feats).detach())
                        counts += torch.bincount(y, minlength=K)
            if method in ("fedtgp", "fedgh"):  # HtFLlib: collect_protos, an eval-mode pass after training
                model.eval()
                with torch.no_grad():
                    for x, y in _batches(pix, a, b, labels, d["train"][cid], bs):
                        sums.index_add_(0, y, model.features(x))
                        counts += torch.bincount(y, minlength=K)
            if method in ("fedproto", "fd", "fedtgp", "fedgh"):
                held = counts > 0
                uploads.append((torch.nonzero(held)[:, 0], sums[held] / counts[held, None], counts[held]))
            elif method == "lg-fedavg":
                uploads.append(({k: v.detach().clone() for k, v in model.head.state_dict().items()}, len(d["train"][cid])))
            elif method == "rafl":
                kn_states.append((k_model.state_dict(), len(d["train"][cid])))
            elif fedavg is not None:
                uploads.append((arch_of[cid], {k: v.detach().clone() for k, v in model.state_dict().items()},
                                len(d["train"][cid])))
        t_update = time.perf_counter() - t_round
        if fedavg is not None:
            _fedavg_server(fedavg, uploads, models, arch_of)
        else:
            _bare_server(st, rnd, uploads, kn_states)
        glob, head = st.glob, st.head
        t_eval = time.perf_counter()
        res = _bare_evaluate(st, d, n)
        acc = {f"{k}.acc_mean_over_clients": statistics.mean(v) for k, v in res.items()}
        now = time.perf_counter()
        rounds_t.append({"round_s": now - t_round, "client_update_s": t_update, "evaluate_s": now - t_eval})
    return {"wall_s": time.perf_counter() - t0, "final": acc, "rounds": rounds_t,
            "train_images": sum(len(d["train"][cid]) for cid in range(n))}


def run_big(args) -> dict:
    """One round at ``--big-clients`` clients (``--big-per-round`` sampled): its evaluation time
    with the untrained clients one by one (``--shared 0``) or together (``--shared 1``)."""
    import torch

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    torch.set_num_threads(1)
    cfg = load_run_config(None, overrides(args, "fedproto", args.big_clients, args.big_limit, args.workers, 1, args.big_per_round)
                          + ["partition.min_samples=4"])
    prep = federate.prepare(cfg, progress=False)
    prep.federation.algorithm.shared_initial_evaluation = bool(args.shared)
    with tempfile.TemporaryDirectory() as d:
        federate.run(prep, Path(d) / "run", progress=False)
        row = json.loads((Path(d) / "run" / "metrics.jsonl").read_text().splitlines()[0])
    return {"evaluate_s": row["time_evaluate_s"], "client_update_s": row["time_client_update_s"],
            "round_s": row["time_s"], "row": {k: v for k, v in row.items() if ".acc_" in k or k.startswith("eval.")}}



# ---------------------------------------------------------------------- the parent
def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def _memory(pid: int) -> tuple[int, int]:
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss



def write_data(args, limit: int | None, clients: int, path: Path) -> None:
    """The images (uint8, N C H W), labels, the per-batch normalization ``x = p * a + b``, every
    client's train and test indices and each method's resolved hyperparameters, for the bare loops."""
    import torch

    from rafl.federation.algorithms import get_algorithm
    from rafl.federation.run_config import load_run_config
    from rafl.stages.prepare import load_data_and_partition

    cfg = load_run_config(None, overrides(args, "fedproto", clients, limit, 1, 1))
    ds, part = load_data_and_partition(cfg, progress=False)
    hps = {}
    for m in {*(XD_METHODS if args.scenario == "crossdevice" else METHODS), *(x.partition("@")[0] for x in args.methods)}:
        c = load_run_config(None, overrides(args, m, clients, limit, 1, 1))
        hps[m] = dict(get_algorithm(m).check_hparams(c.algorithm.hparams()))
    mean = torch.tensor(ds.mean).view(1, -1, 1, 1)
    std = torch.tensor(ds.std).view(1, -1, 1, 1)
    extra = {}
    if args.scenario == "crossdevice":  # rafl's own initial tier subnets (BN-recalibrated) and knowledge network
        from rafl.stages import federate
        from rafl.supernet.arch import ArchConfig
        from rafl.supernet.model import narrow_width

        fed = federate.prepare(cfg, progress=False).federation
        tiers = {}
        for c in fed.clients:
            if c.model_key not in tiers:
                tiers[c.model_key] = fed.client_model(c.client_id).cpu()
        space = fed.server.space
        uniform = ArchConfig.from_string(XD_ARCHS["pi4"], space).to_string()
        assert uniform in tiers
        extra = {"tiers": tiers, "arch_of": [c.model_key for c in fed.clients], "uniform": uniform,
                 "knowledge": narrow_width(fed.server.make_model(space.smallest()), 0.375).cpu(),
                 "feature_dim": next(iter(tiers.values())).feature_dim, "batch_size": args.batch_size}
    torch.save({"pixels": ds.images.pixels.contiguous(), "labels": ds.labels, "a": 1.0 / (255.0 * std), "b": -mean / std,
                "train": [torch.as_tensor(s.train, dtype=torch.int64) for s in part.clients],
                "test": [torch.as_tensor(s.test, dtype=torch.int64) for s in part.clients],
                "n_classes": ds.num_classes, "feature_dim": cfg.clients.feature_dim, "batch_size": 10,
                "hparams": hps, **extra}, path)


def child(args, extra: list[str], base: list[str]) -> dict:
    """Run this script with ``base + extra`` in a child process (niced like this one), sampling its tree's memory."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    cmd = [sys.executable, __file__, "--cifar", str(args.cifar), "--seed", str(args.seed), "--model", args.model,
           "--scenario", args.scenario, "--alpha", str(args.alpha), "--batch-size", str(args.batch_size),
           *base, *extra, "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    load = f"{os.getloadavg()[0]:.1f}"
    proc = subprocess.Popen(cmd, env=env)
    peak = [0, 0]
    while proc.poll() is None:
        rss, pss = _memory(proc.pid)
        peak = [max(peak[0], rss), max(peak[1], pss)]
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"variant {extra} failed with exit code {proc.returncode}")
    res = json.loads(out.read_text())
    out.unlink()
    res["peak_rss_mb"], res["peak_pss_mb"] = peak[0] / 2**20, peak[1] / 2**20
    res["load"] = load
    print(f"  {' '.join(base[-6:] + extra)}: {json.dumps({k: v for k, v in res.items() if k != 'row'})}", flush=True)
    return res


def start_hog(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning in pure Python (a CPU hog), at this process's niceness."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_hog(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
        p.wait()


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def load_now() -> str:
    return ", ".join(f"{v:.1f}" for v in os.getloadavg())


def report(args, res: dict) -> str:
    niceness = os.nice(0)
    cmd = ((f"nice -n {niceness} " if niceness else "") + "python bench/round_speed.py "
           f"--limit-per-class {args.limit_per_class} --clients {args.clients} --rounds {args.rounds} "
           f"--repeats {args.repeats} --methods {','.join(args.methods)}"
           + (f" --hog {args.hog}" if args.hog else "") + f" --memory-limit {args.memory_limit}")
    lines = [
        "# Round speed: every method's rafl rounds vs a bare PyTorch loop doing the same work",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), load average (1, 5, 15 min) "
        f"{res['load_start']} at the start and {res['load_end']} at the end (other jobs on the machine add to "
        "it): ratios of variants run back to back are what this measures; absolute seconds depend on the load.",
        "",
        f"Scenario: CIFAR-10 subset ({args.limit_per_class} images per class from each split, pooled), "
        f"{args.clients} clients, pathological 2 classes each, `{args.model}`, batch 10, 1 local epoch, "
        f"every client every round, evaluation of every client every round, {args.rounds} rounds, 1 torch thread "
        "per process, each method's default hyperparameters (`METHOD@MEANS`: with `class_means: MEANS`). "
        f"Each variant in its own process, {args.repeats} "
        "time(s), alternating order; medians. The bare loops collect prototypes / logits as HtFLlib does: FedProto "
        "and FD in the training pass, FedTGP and FedGH in an extra eval-mode pass (the bench's docstring).",
        "",
        "## Per method, `engine.workers: 1`",
        "",
        "| method | bare loop s | rafl s | ratio rafl / bare | rafl rounds s | client steps s | evaluation s "
        "| engine s | peak RSS MB bare / rafl | final acc bare / rafl |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in args.methods:
        b, r = res["methods"][m]["bare"], res["methods"][m]["w1"]
        fb, fr = b[-1]["final"].get("model.acc_mean_over_clients"), r[-1]["final"].get("model.acc_mean_over_clients")
        lines.append(
            f"| {m} | {med(b, 'wall_s'):.1f} | {med(r, 'wall_s'):.1f} | **{med(r, 'wall_s') / med(b, 'wall_s'):.2f}x** | "
            f"{med(r, 'rounds_s'):.1f} | {med(r, 'client_update_s'):.1f} | {med(r, 'evaluate_s'):.1f} | "
            f"{med(r, 'engine_s'):.1f} | {max(x['peak_rss_mb'] for x in b):.0f} / {max(x['peak_rss_mb'] for x in r):.0f} | "
            f"{fb:.3f} / {fr:.3f} |")
    lines += [
        "",
        "Every run's wall seconds (bare; rafl): " + "; ".join(
            f"{m} " + ", ".join(f"{x['wall_s']:.1f}" for x in res["methods"][m]["bare"]) + "; "
            + ", ".join(f"{x['wall_s']:.1f}" for x in res["methods"][m]["w1"]) for m in args.methods) + ".",
        "`rafl s` is the whole `federate.run` (it includes the end of the run: summary and the two plots); "
        "`rounds s` the sum of the rounds' `time_s`. The bare loops' accuracies differ from rafl's (their own "
        "initialization and shuffling; FedProto / FD prototypes from the training pass); they show the same task "
        "is learned.",
        "",
    ]
    if "workers" in res:
        w = res["workers"]
        lines += [f"## Workers: `engine.workers` 1 vs 2 ({args.workers_method})", "",
                  "| condition | load average at its start | workers 1 s | workers 2 s | ratio w2 / w1 | default "
                  "workers chosen | peak RSS MB w1 / w2 | peak PSS MB w1 / w2 |",
                  "|---|---|---|---|---|---|---|---|"]
        for cond, label in (("quiet", "as the machine is"), ("hog", f"beside a CPU hog ({args.hog} spinning process(es))")):
            if cond not in w:
                continue
            c = w[cond]
            lines.append(
                f"| {label} | {c['load']} | {med(c['w1'], 'wall_s'):.1f} | {med(c['w2'], 'wall_s'):.1f} | "
                f"**{med(c['w2'], 'wall_s') / med(c['w1'], 'wall_s'):.2f}x** | {c['default']} | "
                f"{max(x['peak_rss_mb'] for x in c['w1']):.0f} / {max(x['peak_rss_mb'] for x in c['w2']):.0f} | "
                f"{max(x['peak_pss_mb'] for x in c['w1']):.0f} / {max(x['peak_pss_mb'] for x in c['w2']):.0f} |")
        lines += ["", "`default workers chosen`: what `engine.workers: null` resolves to at that moment "
                  "(`rafl.federation.workers.resolve_workers`: the usable cores minus the load of other processes).",
                  ""]
    if "memory" in res:
        mm = res["memory"]
        lines += [f"## Peak memory ({args.workers_method}, {mm['images']} images in memory, 1 round)", "",
                  "| variant | peak RSS MB | peak PSS MB | vs bare loop (PSS) |", "|---|---|---|---|"]
        base = mm["bare"]["peak_pss_mb"]
        for k, label in (("bare", "bare PyTorch loop (imports torch + rafl.models)"), ("w1", "rafl, workers 1"),
                         ("w2", "rafl, workers 2")):
            lines.append(f"| {label} | {mm[k]['peak_rss_mb']:.0f} | {mm[k]['peak_pss_mb']:.0f} | "
                         f"{mm[k]['peak_pss_mb'] - base:+.0f} MB |")
        lines += ["", "Imports alone (RSS MB after `import`, fresh process): " + ", ".join(
            f"`{k}` {v:.0f}" for k, v in mm["imports"].items()) + ".", ""]
    return "\n".join(lines)


def report_xd(args, res: dict) -> str:
    """The cross-device tables: per method, img/s of the last round (its training, server step and
    engine work; evaluation apart) of the bare loop and of rafl's engine."""
    niceness = os.nice(0)
    cmd = ((f"nice -n {niceness} " if niceness else "") + "OMP_NUM_THREADS=1 python bench/round_speed.py "
           f"--scenario crossdevice --clients {args.clients} --rounds {args.rounds} --repeats {args.repeats} "
           f"--alpha {args.alpha} --batch-size {args.batch_size} --methods {','.join(args.methods)}")
    images = res["train_images"]
    lines = [
        "# Round speed, cross-device: 50 small clients per round, rafl's engine vs a bare PyTorch loop",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), load average (1, 5, 15 min) "
        f"{res['load_start']} at the start and {res['load_end']} at the end (other jobs on the machine add to it): "
        "ratios of variants run back to back are what this measures; absolute img/s depend on the load.",
        "",
        f"Workload: CIFAR-10 minus the shipped `cifar10` supernet's server pool (35,000 images), Dirichlet "
        f"alpha {args.alpha} over {args.clients} clients, each client's images split {XD_SPLIT[0]} / {XD_SPLIT[1]} / "
        f"{XD_SPLIT[2]} (train / val, never read / test): {images:,} training images in all, "
        f"{images / args.clients:.0f} per client on average; every client every round. Clients get the "
        "pi4 / jetson-nano / phone picks of `rafl search --supernet cifar10` (docs/search.md; 4.45 / 6.38 / "
        "8.54 M MACs) round-robin (`uniform`: the pi4 pick for everyone), BN-recalibrated as rafl builds them. "
        f"One local epoch, batch {args.batch_size}, each method's default hyperparameters, one torch thread, "
        f"`engine.workers: 1`. {args.rounds} round(s) per variant after an in-process warm-up (two SGD steps and "
        f"one eval forward of every distinct model, the same in both), each variant in its own process, "
        f"{args.repeats} time(s) in alternating order, medians; the figures are the last round's.",
        "",
        "img/s = training images / (the round's time minus its evaluation): the clients' training plus the "
        "server step plus, for rafl, the engine's work (state files, payloads, screening, metrics, checkpoint). "
        "`client steps` counts the clients' training only (rafl: the round's `time_client_update_s`).",
        "",
        "| method | bare img/s | rafl img/s | **rafl / bare** | client steps img/s bare / rafl | "
        "rafl's round: client steps / server + engine / evaluation s | peak RSS MB bare / rafl | "
        "final acc bare / rafl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in args.methods:
        b, r = res["methods"][m]["bare"], res["methods"][m]["w1"]

        def rate(runs, key=None):
            return statistics.median(images / ((x["rounds"][-1]["round_s"] - x["rounds"][-1]["evaluate_s"])
                                               if key is None else x["rounds"][-1][key]) for x in runs)

        rr = [x["rounds"][-1] for x in r]
        upd = statistics.median(x["client_update_s"] for x in rr)
        ev = statistics.median(x["evaluate_s"] for x in rr)
        rest = statistics.median(x["round_s"] - x["client_update_s"] - x["evaluate_s"] for x in rr)
        ratios = [rate([y]) / rate([x]) for x, y in zip(b, r)]
        fb, fr = b[-1]["final"].get("model.acc_mean_over_clients"), r[-1]["final"].get("model.acc_mean_over_clients")
        lines.append(
            f"| {m} | {rate(b):.1f} | {rate(r):.1f} | **{statistics.median(ratios):.2f}x** | "
            f"{rate(b, 'client_update_s'):.1f} / {rate(r, 'client_update_s'):.1f} | {upd:.1f} / {rest:.1f} / {ev:.1f} | "
            f"{max(x['peak_rss_mb'] for x in b):.0f} / {max(x['peak_rss_mb'] for x in r):.0f} | "
            f"{fb:.3f} / {fr:.3f} |")
    lines += [
        "",
        "Load average (1 min) when each variant started: " + "; ".join(
            f"{m} " + ", ".join(f"{x['load']}" for x in res["methods"][m]["bare"]) + " / "
            + ", ".join(f"{x['load']}" for x in res["methods"][m]["w1"]) for m in args.methods) + " (bare / rafl).",
        "",
        "The bare loops are the cnn4 scenario's (`run_bare`, the same nn.Modules rafl trains, copied per client), "
        "with FedAvg's server step for `uniform`, and for `heterofl` a FedAvg per tier subnet: the same client "
        "arithmetic, a cheaper server step than HeteroFL's masked average into the supernet (rafl's extra server "
        "work is in its `server + engine` column). Accuracies after one round differ between the two (their own "
        "shuffling; FedProto's prototypes from the training pass in the bare loop); they only show both learn.",
        "",
    ]
    return "\n".join(lines)


def import_rss() -> dict[str, float]:
    out = {}
    for mods in ("torch", "torch,torchvision", "torch,rafl.models", "rafl.stages.federate"):
        code = ("import importlib\nfor m in %r.split(','): importlib.import_module(m)\n"
                "print([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])") % mods
        out[mods.replace(",", " + ")] = int(subprocess.check_output([sys.executable, "-c", code])) / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cifar", type=Path, default=TREE if TREE.is_dir() else TARBALL)
    ap.add_argument("--scenario", choices=["cnn4", "crossdevice"], default="cnn4",
                    help="crossdevice: 50 clients of ~90 images on the cifar10 supernet's tier subnets (docstring)")
    ap.add_argument("--model", default="cnn4")
    ap.add_argument("--limit-per-class", type=int, default=100)
    ap.add_argument("--clients", type=int, default=None, help="default 10 (cnn4), 50 (crossdevice)")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (cnn4), 1 (crossdevice)")
    ap.add_argument("--repeats", type=int, default=None, help="default 2 (cnn4), 1 (crossdevice)")
    ap.add_argument("--alpha", type=float, default=0.5, help="crossdevice: Dirichlet alpha")
    ap.add_argument("--batch-size", type=int, default=32, help="crossdevice: local batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=None)
    ap.add_argument("--workers-method", default="fedproto")
    ap.add_argument("--hog", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                    help="spinning processes beside the workers run (0: skip)")
    ap.add_argument("--memory-limit", type=int, default=3000, help="images per class and split of the memory case "
                    "(0: skip it; 3000: the whole CIFAR-10)")
    ap.add_argument("--memory-clients", type=int, default=100)
    ap.add_argument("--memory-per-round", type=int, default=4)
    ap.add_argument("--big-clients", type=int, default=0, help="3000: the large evaluation round of issue 35")
    ap.add_argument("--big-per-round", type=int, default=10)
    ap.add_argument("--big-limit", type=int, default=None, help="images per class for the large round (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "round_speed")
    ap.add_argument("--variant", choices=["bare", "rafl", "big"], help=argparse.SUPPRESS)
    ap.add_argument("--method", default="fedproto", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bare-clients", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--per-round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--shared", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    xd = args.scenario == "crossdevice"
    for key, cnn4, crossdevice in (("clients", 10, 50), ("rounds", 3, 1), ("repeats", 2, 1),
                                   ("methods", METHODS, XD_METHODS)):
        if getattr(args, key) is None:
            setattr(args, key, crossdevice if xd else cnn4)
    if xd:
        args.limit_per_class, args.hog, args.memory_limit = None, -1, 0
        if args.out == ROOT / "bench" / "results" / "round_speed":
            args.out = ROOT / "bench" / "results" / "round_speed_crossdevice"
    if args.variant:
        out = {"bare": run_bare, "rafl": run_rafl, "big": run_big}[args.variant](args)
        args.json.write_text(json.dumps(out))
        return
    res: dict = {"load_start": load_now(), "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.pt"
        write_data(args, args.limit_per_class, args.clients, data)
        if xd:
            import torch

            res["train_images"] = sum(len(t) for t in torch.load(data, weights_only=False)["train"])
        base = [*(["--limit-per-class", str(args.limit_per_class)] if args.limit_per_class else []),
                "--clients", str(args.clients), "--rounds", str(args.rounds)]
        for m in args.methods:
            variants = {"bare": ["--variant", "bare", "--data", str(data), "--method", m],
                        "w1": ["--variant", "rafl", "--method", m, "--workers", "1"]}
            runs: dict[str, list[dict]] = {k: [] for k in variants}
            for rep in range(args.repeats):
                for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                    runs[name].append(child(args, variants[name], base))
            res["methods"][m] = runs
        if args.hog >= 0:
            import torch

            from rafl.federation.workers import resolve_workers

            res["workers"] = {}
            for cond in ("quiet", "hog") if args.hog else ("quiet",):
                hog = start_hog(args.hog) if cond == "hog" else []
                try:
                    if hog:
                        time.sleep(20)  # let the load average see the hog
                    c = {"load": load_now(), "w1": [], "w2": [],
                         "default": resolve_workers(None, args.clients, torch.device("cpu"))}
                    for rep in range(args.repeats):
                        for w in ((1, 2) if rep % 2 == 0 else (2, 1)):
                            c[f"w{w}"].append(child(args, ["--variant", "rafl", "--method", args.workers_method,
                                                           "--workers", str(w)], base))
                finally:
                    stop_hog(hog)
                res["workers"][cond] = c
        if args.memory_limit:
            mdata = Path(tmp) / "memory.pt"
            write_data(args, args.memory_limit, args.memory_clients, mdata)
            mbase = ["--limit-per-class", str(args.memory_limit), "--clients", str(args.memory_clients), "--rounds", "1"]
            mm = {"bare": child(args, ["--variant", "bare", "--data", str(mdata), "--method", args.workers_method,
                                       "--bare-clients", str(args.memory_per_round)], mbase)}
            for w in (1, 2):
                mm[f"w{w}"] = child(args, ["--variant", "rafl", "--method", args.workers_method, "--workers", str(w),
                                           "--per-round", str(args.memory_per_round)], mbase)
            import torch

            mm["images"] = int(torch.load(mdata, weights_only=False)["labels"].numel())
            mm["imports"] = import_rss()
            res["memory"] = mm
    res["load_end"] = load_now()
    text = report_xd(args, res) if xd else report(args, res)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         **res}, indent=1) + "\n")
    print(text)
    if args.big_clients:
        big = {}
        for key, shared in (("one_by_one", 0), ("shared", 1)):
            big[key] = child(args, ["--variant", "big", "--workers", "1", "--shared", str(shared)],
                             ["--big-clients", str(args.big_clients), "--big-per-round", str(args.big_per_round),
                              *(["--big-limit", str(args.big_limit)] if args.big_limit else [])])
        (args.out.parent / "round_speed_eval.json").write_text(json.dumps(big, indent=1) + "\n")
        print(json.dumps(big, indent=1))


if __name__ == "__main__":
    main()
