"""FedGH: heterogeneous federated learning with a generalized global header.

Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header", ACM MM 2023.
Every client ``k`` has its own feature extractor ``f_k`` (any architecture with the same
representation width ``r``) and uses the global header ``H(theta)``:

1. *Local training*: the client model ``H(f_k(x))`` (the broadcast global header replaces the
   local one) is trained with cross-entropy (Sec. 4.1).
2. *LAR*: with the trained extractor the client computes, with a running per-class sum (one
   O(n) pass), the local averaged representation of every class ``s`` it holds,
   ``bar R_k^s = 1/|D_k^s| sum_{(x, y=s)} f_k(x)`` (Sec. 4.2), and uploads the S LARs and their
   S class labels: ``(S + S*r) x 32`` bits (Sec. 4.3). Classes a client does not hold send nothing.
3. *Global header training*: the server feeds each LAR into the header with cross-entropy and
   SGD, ``theta <- theta - eta_theta * grad CE(H(bar R_k^s; theta), s)`` with ``eta_theta = 0.01``
   (Algorithm 1), one client at a time in client-id order (``server_mode: per-lar``, one step per
   LAR as in the paper) or each client's LARs as one mini-batch (``server_mode: per-client``),
   for ``server_epochs`` passes over the round's LARs: 1 as in Algorithm 1 (default); HtFLlib's
   FedGH (``servergh.py``, the FedTGP paper's FedGH baseline) makes 100. The count trades the
   scenarios against each other (``bench/fedgh_sweep.py``, ``bench/results/fedgh_sweep.md``):
   100 passes fit the header to the round's LARs, which wins big when clients hold few classes
   and few samples (digits pathological 2/10, 20% train: +0.07 points vs Standalone with 1 pass,
   +14.3 with 100) and loses under Dirichlet label skew (plausibly because a rare class's LAR is
   one or two noisy samples; CIFAR-10 Dirichlet 0.1: -3.3 with 1 pass, -9.0 with 100; 4 seeds each).
4. The new header is broadcast and replaces every client's local header (also before
   evaluation, :meth:`FedGH.prepare_evaluation`).

Evaluation reports three inference rules of one client, all on its current feature extractor
(one pass, :func:`rafl.federation.training.evaluate_header_rules`): ``model.*`` the deployed rule
(below), ``prior.*`` the global header plus the client's log label prior, and ``local.*`` the
header as the client fine-tuned it from the previous global header in its last local training
(step 1). Option ``deploy_header`` picks the deployed header: ``global`` (default, the paper's
step 4: the broadcast header replaces the local one; HtFLlib's FedGH also evaluates right after
this broadcast) or ``local`` (the model as it leaves local training, as a personalized-FL
evaluation would take it; not in the paper). A client not yet sampled (participation rate < 1)
has not trained: its local header is still its initial one.

Option ``label_prior: local`` (not in the paper; off by default): the deployed model adds the
client's log label prior to the global header's logits (post-hoc logit adjustment, Menon et al.,
"Long-tail learning via logit adjustment", ICLR 2021, Eq. 4, applied with the client's own prior).
The global header is trained on one LAR per class and client, so it is close to class-balanced
and cannot know a client's label skew; a local head (Standalone, FedProto, FedTGP) learns it.
On CIFAR-10 Dirichlet 0.1 it turns FedGH's -3.26 points vs Standalone into +1.16 (4/4 seeds;
30 rounds, ``bench/results/htfl_bench_cifar10-dir0.1.md``). Nothing extra is uploaded.

Wire format: upload tensors ``lar.values (S, r) float32`` and ``lar.labels (S,) int32`` (no
metadata); broadcast ``head.<key>`` tensors. The safetensors header (names, dtypes, shapes) is
the only overhead over the formula; ``bench/htfl_bench.py`` prints both.

Where each step lives: local training (step 1) and the LARs (step 2) :meth:`FedGH.client_update`
(:func:`rafl.federation.training.train_ce`,
:func:`rafl.federation.prototypes.local_class_averages`); the upload's check
:meth:`FedGH.check_upload`; global header training (step 3) :meth:`FedGH.server_aggregate`
(:func:`train_global_header`); the broadcast header replacing the client's (step 4) at the start of
:meth:`FedGH.client_update` and before evaluation :meth:`FedGH.prepare_evaluation`; evaluation
:meth:`FedGH.evaluate`.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rafl.errors import UserInputError, shown
from rafl.federation.aggregation import bound_vectors
from rafl.federation.algorithms._common import build, cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Accuracy, Algorithm, ClientContext, ServerContext, register
from rafl.federation.algorithms.hparams import Float, Hyperparameters, Int, LocalTraining, bounded, choice
from rafl.federation.headers import common_header, head_state, load_head
from rafl.federation.payload import Payload
from rafl.federation.prototypes import check_class_upload, from_payload, local_class_averages, to_payload_tensors
from rafl.federation.training import NoSingletonBatches, evaluate_header_rules, train_ce, train_sgd

HEAD = "head."
LAR = "lar."
SERVER_MODES = ("per-lar", "per-client")
ServerMode = choice(*SERVER_MODES)
#: a global header with a weight above this came from a diverged server step (a trained linear header's are O(1))
HEADER_BLOWUP = 1e3
LABEL_PRIORS = ("none", "local")
LabelPrior = choice(*LABEL_PRIORS)
DEPLOY_HEADERS = ("global", "local")
DeployHeader = choice(*DEPLOY_HEADERS)


def log_label_prior(counts: torch.Tensor) -> torch.Tensor:
    """``log pi(y)`` (K,) of a client's training labels with add-one (Laplace) smoothing, so a
    class the client does not hold gets a finite, low prior: ``log((n_y + 1) / (n + K))``.

    Args:
        counts: (K,) per-class training-sample counts.
    """
    c = counts.to(torch.float32) + 1.0
    return (c / c.sum()).log()


class PriorAdjusted(nn.Module):
    """``model(x) + log_prior``: logits (B, K) adjusted by a fixed (K,) log label prior
    (logit adjustment, Menon et al., ICLR 2021, Eq. 4): the deployable form of a client's model
    with ``label_prior: local`` (evaluation applies the same offset in one pass,
    :func:`rafl.federation.training.evaluate_header_rules`)."""

    def __init__(self, model: nn.Module, log_prior: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("log_prior", log_prior)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) + self.log_prior


def train_global_header(header: torch.nn.Module, client_lars: list[dict[int, torch.Tensor]], *, lr: float = 0.01,
                        epochs: int = 1, mode: str = "per-lar", max_grad_norm: float = 0.0,
                        device: torch.device | str = "cpu") -> float:
    """FedGH's server step (Yi et al., Algorithm 1, lines "server"): SGD on ``CE(H(bar R), s)``.

    Args:
        header: the global header ``(B, r) -> (B, K)`` (trained in place).
        client_lars: per uploading client, in client-id order, ``{class s (int): bar R (r,)}``.
        lr: eta_theta (paper: 0.01).
        epochs: passes over all clients' LARs.
        mode: ``"per-lar"`` (one SGD step per LAR, clients and classes in order, the paper) or
            ``"per-client"`` (one step per client on its LARs as a mini-batch).
        max_grad_norm: clip each step's gradient to this L2 norm (``torch.nn.utils.clip_grad_norm_``);
            0 = no clipping (the paper). Not in the paper: a guard against one client's outlying
            LARs (e.g. a BatchNorm extractor whose eval-mode representation has a norm in the
            thousands) making a step that blows the shared header up for every client.
        device: where to compute.

    Returns:
        the mean CE loss over the steps (0.0 when there was nothing to train on).

    Raises:
        UserInputError: unknown ``mode``; a NaN/Inf loss or header (naming ``algorithm.server_lr``).
    """
    if mode not in SERVER_MODES:
        raise UserInputError(f"is {shown(mode)}; allowed: {', '.join(SERVER_MODES)}", field="algorithm.server_mode")
    # eval mode: the header's dropout (if any) stays off on the few LARs, and BN (if any) keeps its
    # statistics; gradients flow as usual
    header.to(device).eval()

    def batches():
        for lars in client_lars:
            if not lars:
                continue
            classes = sorted(lars)
            x = torch.stack([lars[c] for c in classes]).to(device)
            y = torch.tensor(classes, dtype=torch.long, device=device)
            yield from ([(x[i:i + 1], y[i:i + 1]) for i in range(len(y))] if mode == "per-lar" else [(x, y)])

    history = train_sgd(header, batches, lambda b: F.cross_entropy(header(b[0]), b[1]), epochs=epochs, lr=lr,
                        max_grad_norm=max_grad_norm, what="server training of the global header",
                        field="algorithm.server_lr")
    losses = [v for epoch in history for v in epoch]
    return sum(losses) / len(losses) if losses else 0.0


class FedGHHparams(LocalTraining):
    """FedGH's hyperparameters (Yi et al., ACM MM 2023): the server's training of the global header
    on the uploaded local averaged representations (Algorithm 1) and its deployment."""

    server_lr: Float = bounded(0.01, gt=0)             # eta_theta
    server_epochs: Int = bounded(1, ge=1)              # passes over the round's LARs (Algorithm 1; HtFLlib: 100)
    server_mode: ServerMode = "per-lar"                # per-lar (paper) | per-client (a client's LARs: one batch)
    server_max_grad_norm: Float = bounded(10.0, ge=0)  # clip each server step's gradient norm; 0 = off (the paper)
    label_prior: LabelPrior = "none"                   # none (paper) | local: add the client's log label prior
    deploy_header: DeployHeader = "global"             # global (paper) | local: the header as fine-tuned locally


@register
class FedGH(Algorithm):
    """FedGH (Yi et al., MM 2023). Client state ``{"model": state_dict}``; server state
    ``{"head": header state_dict}``."""

    name: ClassVar[str] = "fedgh"
    accuracies: ClassVar[tuple[Accuracy, ...]] = (
        DEPLOYED, Accuracy("prior", "+prior", "global header + local label prior accuracy", "+prior"),
        Accuracy("local", "local header", "locally fine-tuned header accuracy", "local-header"))
    # evaluate() applies each client's own label prior (its training split's label counts)
    shared_initial_evaluation: ClassVar[bool] = False
    hparams_model: ClassVar[type[Hyperparameters]] = FedGHHparams

    @classmethod
    def check_hparams(cls, hparams):
        """:class:`FedGHHparams` checked; also rejects ``label_prior: local`` with ``deploy_header:
        local`` (the prior adjusts the global header; a locally fine-tuned header has already
        learned it)."""
        hp = super().check_hparams(hparams)
        if hp["label_prior"] == "local" and hp["deploy_header"] == "local":
            raise UserInputError("is local, which adjusts the global header; with deploy_header: local the "
                                 "deployed header was fine-tuned on the client's labels and has learned their "
                                 "prior already; allowed with it: none", field="algorithm.label_prior")
        return hp

    def init_server(self, server: ServerContext):
        model = common_header(server.make_model, server.clients, self.name)
        head = head_state(model)
        return {"head": head}, Payload.from_state_dict(head, HEAD)

    def init_client(self, client: ClientContext):
        return {"model": cpu_state(client.make_model())}

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        model = build(client, state["model"])
        load_head(model, broadcast.state_dict(HEAD), f"client {client.client_id} head")
        try:
            train_ce(model, NoSingletonBatches(client.train_loader), optimizer_for(model, hp),
                     epochs=hp["local_epochs"], device=client.device)
        except UserInputError as err:  # the global header it started from may be the cause
            size = max((float(v.abs().max()) for v in broadcast.state_dict(HEAD).values() if v.numel()), default=0.0)
            if size > HEADER_BLOWUP:  # the server's step blew the header up: blame its learning rate
                raise UserInputError(f"{err.message.split('; allowed:')[0]} from a global header with weights up to "
                                     f"{size:.3g} (a trained linear header's are O(1)); allowed: a smaller "
                                     "algorithm.server_lr, or algorithm.server_max_grad_norm > 0",
                                     field="algorithm.server_lr") from None
            raise UserInputError(f"{err.message} (the global header it starts from has weights up to {size:.3g}: "
                                 "if that is large, lower algorithm.server_lr or keep server_max_grad_norm on)",
                                 field=err.field) from None
        lars, counts = local_class_averages(model, client.train_loader, client.n_classes, device=client.device)
        return {"model": cpu_state(model), "label_counts": _count_tensor(counts, client.n_classes)}, \
            Payload(to_payload_tensors(lars, LAR))

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        hp = self.hparams
        ordered = sorted(uploads, key=lambda u: int(u.meta.get("client_id", 0)))  # client-id order
        header = copy.deepcopy(common_header_module(server, server_state["head"]))
        train_global_header(header, bound_vectors([from_payload(u.tensors, LAR) for u in ordered], server),
                            lr=hp["server_lr"],
                            epochs=hp["server_epochs"], mode=hp["server_mode"],
                            max_grad_norm=hp["server_max_grad_norm"], device=server.device)
        head = {k: v.detach().cpu().clone() for k, v in header.state_dict().items()}
        return {"head": head}, Payload.from_state_dict(head, HEAD)

    def check_upload(self, upload, server_state, client, n_classes):
        """LARs: ``lar.values (S, r)`` with r the global header's input width, ``lar.labels (S,)``
        distinct class ids < K (:func:`rafl.federation.prototypes.check_class_upload`)."""
        dim = next((v.shape[1] for v in server_state["head"].values() if v.ndim == 2), None)
        check_class_upload(upload.tensors, LAR, n_classes=n_classes, dim=dim)

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        head = broadcast.state_dict(HEAD)
        if not head:
            return state
        model = build(client, state["model"])
        local_head = head_state(model)
        load_head(model, head, f"client {client.client_id} head")
        return {**state, "model": cpu_state(model), "local_head": local_head}

    def evaluate(self, state, client: ClientContext):
        """``model.*``: the deployed rule (``deploy_header``, ``label_prior``); ``prior.*``: the
        global header plus the client's log label prior; ``local.*``: the header from the client's
        last local training. One pass shows every rule (like FedTGP's ``proto.*``)."""
        model = build(client, state["model"])
        local_head = model.head
        if state.get("local_head") is not None:  # prepare_evaluation put the global header in the model
            local_head = copy.deepcopy(model.head)
            local_head.load_state_dict(state["local_head"])
        counts = state.get("label_counts")
        if counts is None:  # not trained yet: count the labels of the training split
            counts = torch.zeros(client.n_classes, dtype=torch.int64)
            for _, labels in client.train_loader:
                counts += torch.bincount(labels, minlength=client.n_classes)
        acc = evaluate_header_rules(model, client.test_loader,
                                    {"global": (model.head, None), "prior": (model.head, log_label_prior(counts)),
                                     "local": (local_head, None)}, device=client.device)
        hp = self.hparams
        deployed = acc["local"] if hp["deploy_header"] == "local" else \
            acc["prior"] if hp["label_prior"] == "local" else acc["global"]
        return {**eval_counts("prior", *acc["prior"]), **eval_counts("local", *acc["local"]),
                **eval_counts(DEPLOYED.prefix, *deployed)}


def _count_tensor(counts: dict[int, int], n_classes: int) -> torch.Tensor:
    out = torch.zeros(n_classes, dtype=torch.int64)
    for c, n in counts.items():
        out[c] = n
    return out


def common_header_module(server: ServerContext, head: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A header module of client 0's architecture holding ``head`` (the server-side copy of H)."""
    model = server.make_model(client_id=server.clients[0].client_id)
    load_head(model, head, "server header")
    return model.head
