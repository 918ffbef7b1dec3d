"""HeteroFL: every client trains its own slice of one global model; the server averages each weight
over the clients holding it.

Diao et al., "HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous
Clients", ICLR 2021. Each round a client downloads the slice of the global weights its model holds,
trains it locally (cross-entropy, as FedAvg), and uploads it; the server sets every element of the
global model to the weighted average over the uploads that hold it (Eq. 3); elements no sampled
client holds keep their value (:func:`rafl.federation.weight_sharing.masked_average`).

The global model and the slices (:mod:`rafl.federation.weight_sharing`):

* **NAS subnets** (``clients.models: nas``): the global model is the OFA supernet itself. A subnet
  holds the first ``d`` blocks of every stage (elastic depth), the first expanded channels of every
  block (elastic expand; ofa sorts them by importance, so the prefix keeps the most important ones),
  the centre ``k x k`` of the largest depthwise kernel (elastic kernel) and the stem, the first block
  and the head whole. OFA's kernel transformation matrices (Cai et al. 2020, Sec. 3.2: a smaller
  kernel is a learned linear map of the larger kernel's centre) are folded into the kernels once, at
  the start (:func:`~rafl.federation.weight_sharing.fold_kernel_transforms`: per block, nested from
  the largest kernel down to the smallest one a client uses there, so the clients of that smallest
  kernel start with exactly the supernet's filter and larger kernels keep their outer ring) and
  those matrices set to the identity; matrices into kernels smaller than any client's stay OFA's.
  No matrix is ever sent or averaged. Since the folded matrices are the identity, ofa's own
  extraction of the global model is the centre crop HeteroFL slices by for every kernel a client
  uses, and the server's final global model is a supernet (``supernet.safetensors`` in the run
  dir) that ``rafl search --supernet RUN_DIR`` searches again.
* **Width-sliced models** (``clients.models: heterofl-cnn4``, ``heterofl-resnet18`` or any mix of
  ``<base>@<rate>``, :mod:`rafl.models.sliced`): the global model is the widest member; a narrower one
  holds the leading slice of every dimension. ``scaler`` (default true, the paper's Sec. 3.2)
  divides every hidden layer's output by the client's rate during local training.

Aggregation weights (``weighting``): ``samples`` (default) weights a client by its number of training
samples as the server knows it (``ClientInfo.n_samples``; an upload's own claim is ignored), FedAvg's
``n_l / n`` restricted to the holders of each element; ``count`` weights every holder equally (the
paper's Eq. 3 is the plain mean over holders).

Robust aggregation (``engine.aggregation``, default ``norm_clip``): every upload's update of its
slice is clipped before Eq. 3 (to ``engine.clip_norm``, or relative to the round's lower-median
weighted RMS update, so no client outweighs the largest honest one); ``median`` and
``trimmed_mean`` replace Eq. 3's mean by the coordinate-wise rule over the holders of each element
(:func:`~rafl.federation.weight_sharing.masked_average`). Under ``mean`` a federation whose clients
all hold the whole model is FedAvg bit for bit; under ``norm_clip`` it equals FedAvg's ``norm_clip``.

BatchNorm statistics: by default (``static_bn: false``) the running statistics are averaged like
every other weight (FedAvg's rule). ``static_bn: true`` is the paper's static BN (sBN, Sec. 3.2): running
statistics are never sent up or averaged, and training normalizes by batch statistics. Where the
statistics of the model a client evaluates (its slice of the latest global model) come from is
``sbn_statistics``:

* ``local`` (default): measured on the client's own training data (one pass,
  :func:`rafl.federation.training.recalibrate_local_bn`);
* ``server``: measured by the server on its public pool after every aggregation, per client model
  (BN recalibration on the fixed class-mixed sample of 512 public images that every searched subnet
  and the no-training floor are recalibrated on), and sent down with the slice. The paper queries the
  clients once after training and accumulates global statistics over all their data; the public
  pool is a sample of the same distribution as the clients' union, and needs no extra message.
  A slice fine-tuned on the client (the ``-ft`` row of ``rafl compare``) carries no statistics
  (its upload) and is scored with statistics measured on the client's own training data.
  Re-scoring the final global model of the fair headline's HeteroFL run (CIFAR-10, seed 0, lr
  0.003, trained with averaged statistics), its deployed slices score 0.764 / 0.781 / 0.786 on the
  balanced global test set (pi4 / jetson-nano / phone) with these statistics, 0.747 / 0.740 /
  0.722 with the averaged ones.

``train.bn_statistics`` (:mod:`rafl.federation.bn_statistics`) replaces this rule for every method:
``client`` / ``server`` re-estimate the deployed slice's statistics when it is scored (with averaged
or static BN alike), ``local`` is FedBN (not with ``static_bn``): the client state holds the client's
BN layers after its first training, put into every slice it downloads.

With ``local`` on digits (the
quickstart pipeline, 6 clients, Dirichlet 0.5, 1 round of 1 epoch) sBN with per-client statistics
measured 0.679 mean client accuracy against 0.892 with averaged statistics (one subnet for every
client: 0.741 vs 0.934): a label-skewed client's few images give statistics that fit the global
weights worse than the average over clients does.

Reported per client: ``model`` = the client's slice of the latest global model on its test split.

State: client ``{}``; server ``{"global": state_dict, "layout": JSON}``. The broadcast holds the
whole global model plus ``meta = {"round", "layout"}``; :meth:`HeteroFL.client_broadcast` cuts
each client's slice out of it, and that slice is what is downloaded and counted. Upload: the
client's trained ``state_dict`` (without BN statistics under ``static_bn``), meta ``n_samples``. Under
``sbn_statistics: server`` the server state also holds ``"sbn"`` (model key -> BN statistics) and the
broadcast carries them as ``sbn.<i>.<key>`` for model ``i`` of ``meta["sbn"]`` (JSON list); each
client downloads only its own model's.

Where each step lives: the global model's layout and first weights :meth:`HeteroFL.layout`; a
client's slice of the broadcast :meth:`HeteroFL.client_broadcast` (:func:`index_map`); local
training :meth:`HeteroFL.client_update`; the average over each element's holders (Eq. 3)
:meth:`HeteroFL.server_aggregate` (:func:`rafl.federation.weight_sharing.masked_average`), static
BN's server statistics :meth:`HeteroFL.server_bn_statistics`; evaluation
:meth:`HeteroFL.prepare_evaluation` and :meth:`HeteroFL.evaluate`; the final global model as a
supernet :meth:`HeteroFL.federated_supernet`.
"""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar

import numpy as np
import torch

from rafl.errors import UserInputError
from rafl.federation.algorithms._common import cpu_state, eval_counts, optimizer_for
from rafl.federation.algorithms.base import DEPLOYED, Algorithm, ClientContext, ClientInfo, ServerContext, register
from rafl.federation.algorithms.hparams import Bool, Hyperparameters, LocalTraining, choice
from rafl.federation.bn_statistics import own_bn, with_own_bn
from rafl.federation.payload import Payload
from rafl.federation.training import evaluate_accuracy, recalibrate_local_bn, train_ce
from rafl.federation.weight_sharing import (
    IndexMap,
    extract,
    fold_kernel_transforms,
    is_kernel_matrix,
    masked_average,
    middle_channels,
    nas_index_map,
    prefix_index_map,
    smallest_kernels,
)
from rafl.models.sliced import set_scalers
from rafl.supernet.arch import SearchSpace
from rafl.supernet.model import Subnet, build_supernet, recalibrate_bn
from rafl.supernet.server_data import CALIBRATION_BATCH, CALIBRATION_IMAGES, calibration_sample

BN_STATS = ("running_mean", "running_var", "num_batches_tracked")
WEIGHTINGS = ("samples", "count")
Weighting = choice(*WEIGHTINGS)
SBN_STATISTICS = ("local", "server")
SbnStatistics = choice(*SBN_STATISTICS)


def is_bn_stat(key: str) -> bool:
    """Whether a state-dict key is a BatchNorm running statistic (or its counter)."""
    return key.rsplit(".", 1)[-1] in BN_STATS


@functools.lru_cache(maxsize=64)
def _sliced_map(layout_json: str, model_key: str, round_: int | None) -> tuple[tuple[str, tuple[int, ...], bytes], ...]:
    layout = json.loads(layout_json)
    local = {k: torch.empty(tuple(s)) for k, s in layout["shapes"][model_key].items()}
    glob = {k: torch.empty(tuple(s)) for k, s in layout["shapes"][layout["global"]].items()}
    index = prefix_index_map(local, glob, round_=round_, name=f"model {model_key!r}")
    return tuple((k, tuple(v[1].shape), v[1].reshape(-1).numpy().astype(np.int64).tobytes()) for k, v in index.items())


def index_map(layout_json: str, info: ClientInfo, round_: int, rolling: bool) -> IndexMap:
    """Client ``info``'s slice of the global model in round ``round_`` (FedRolex's window when ``rolling``)."""
    layout = json.loads(layout_json)
    if layout["kind"] == "nas":
        space = SearchSpace.from_dict(layout["space"])
        shifts = [(int(round_) - 1) % m for m in layout["middle"]] if rolling else None
        return nas_index_map(space, info.arch, shifts)
    out: IndexMap = {}
    for k, shape, raw in _sliced_map(layout_json, info.model_key, int(round_) if rolling else None):
        out[k] = (k, torch.from_numpy(np.frombuffer(raw, dtype=np.int64).copy()).reshape(shape))
    return out


class HeteroFLHparams(LocalTraining):
    """HeteroFL's hyperparameters (Diao et al., ICLR 2021): how the slices are averaged (Eq. 3), its
    static BatchNorm (Sec. 3.2; ``sbn_statistics``: where its evaluation statistics are measured,
    ``local`` or ``server``) and scaler module."""

    weighting: Weighting = "samples"
    static_bn: Bool = False
    sbn_statistics: SbnStatistics = "local"
    scaler: Bool = True


@register
class HeteroFL(Algorithm):
    """HeteroFL (Diao et al., ICLR 2021) over NAS subnets or width-sliced models (module docstring)."""

    name: ClassVar[str] = "heterofl"
    hparams_model: ClassVar[type[Hyperparameters]] = HeteroFLHparams
    #: FedRolex's rolling window instead of HeteroFL's fixed prefix
    rolling: ClassVar[bool] = False
    global_model: ClassVar[bool] = True
    exports_supernet: ClassVar[bool] = True

    # ------------------------------------------------------------------ layout
    def layout(self, server: ServerContext) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(layout, initial global state)`` for the population of ``server``.

        Raises:
            UserInputError: clients whose subnets are not all of the federation's supernet (another
                search space, or some subnets and some other models); model-group members that are
                not width-sliceable from the widest one (other layers, or a wider dimension).
        """
        infos = server.clients
        nas = [c for c in infos if c.arch is not None]
        if nas:
            return self._nas_layout(server, nas)
        models: dict[str, dict[str, torch.Tensor]] = {}
        for c in infos:
            if c.model_key not in models:
                models[c.model_key] = cpu_state(server.make_model(client_id=c.client_id))
        widest = max(models, key=lambda k: (sum(t.numel() for t in models[k].values()), k))
        shapes = {k: {n: list(t.shape) for n, t in sd.items()} for k, sd in models.items()}
        layout = {"kind": "sliced", "global": widest, "shapes": shapes}
        for key, sd in models.items():  # raises for a model that is not a slice of the widest
            prefix_index_map(sd, models[widest], name=f"model {key!r}")
        return layout, models[widest]

    def _nas_layout(self, server: ServerContext, nas: list[ClientInfo]):
        supernet, space = server.supernet, server.space
        others = [c.client_id for c in server.clients if c.arch is None]
        if supernet is None or space is None or others:
            raise UserInputError(f"{self.name} needs every client's model cut from one supernet; "
                                 f"{'clients ' + str(others[:5]) + ' have other models' if others else 'the run has no supernet'}; "
                                 "allowed: clients.models: nas (every client a subnet of supernet.path), or a width-sliced "
                                 "group (heterofl-cnn4, heterofl-resnet18)", field="clients.models")
        want = space.to_dict()
        for c in nas:
            model = server.make_model(arch=c.arch)
            theirs = model.space.to_dict() if isinstance(model, Subnet) else None
            try:
                ok = theirs == want and c.arch.validate(space) is not None
            except UserInputError:
                ok = False
            if not ok:
                raise UserInputError(f"client {c.client_id}'s subnet {c.model_key} comes from another supernet than the "
                                     f"federation's ({'a ' + type(model).__name__ if theirs is None else 'search space '}"
                                     f"{'' if theirs is None else json.dumps(theirs)}); "
                                     f"{self.name} averages the weights of one supernet; allowed: subnets of the search space "
                                     f"{json.dumps(want)}", field="clients.archs")
        layout = {"kind": "nas", "space": want, "middle": middle_channels(space)}
        state = fold_kernel_transforms(supernet, smallest_kernels(supernet, [c.arch for c in nas]))
        if not self.hparams["static_bn"]:
            # the clients start from the statistics of their own (BN-recalibrated) subnet
            seen = set()
            for c in nas:
                if c.model_key in seen:
                    continue
                seen.add(c.model_key)
                index = nas_index_map(space, c.arch)
                sub = cpu_state(server.make_model(arch=c.arch))
                for k, t in sub.items():
                    if is_bn_stat(k):
                        g, flat = index[k]
                        state[g].view(-1)[flat.reshape(-1)] = t.reshape(-1).to(state[g].dtype)
        return layout, state

    @classmethod
    def check_hparams(cls, hparams: dict[str, Any]) -> dict[str, Any]:
        """The defaults merged with ``hparams``, checked.

        Raises:
            UserInputError: as :meth:`Algorithm.check_hparams`, or ``sbn_statistics: server``
                without ``static_bn: true`` (averaged statistics have no static BN to measure).
        """
        hp = super().check_hparams(hparams)
        if hp["sbn_statistics"] == "server" and not hp["static_bn"]:
            raise UserInputError("sbn_statistics: server measures static BN's statistics, and static_bn is false; "
                                 "allowed: sbn_statistics: server with static_bn: true, or sbn_statistics: local",
                                 field="algorithm.sbn_statistics")
        return hp

    def check_models(self, server: ServerContext) -> None:
        """Raises UserInputError: as :meth:`layout`, or ``sbn_statistics: server`` in a run without a
        public pool."""
        self.layout(server)
        if self._server_bn:
            self._calibration_batches(server)

    def reads_public_pool(self) -> bool:
        """Static BN's ``sbn_statistics: server`` measures statistics on the public pool."""
        return super().reads_public_pool() or self._server_bn

    def deployed_bn_statistics(self) -> str:
        """``averaged`` (default), or static BN's ``server`` / ``client`` (``sbn_statistics: local``)."""
        if not self.hparams["static_bn"]:
            return "averaged"
        return "server" if self.hparams["sbn_statistics"] == "server" else "client"

    def supports_local_bn(self) -> bool:
        """FedBN keeps a client's BN layers, statistics included: not with static BN (never sent)."""
        return not self.hparams["static_bn"]

    # ------------------------------------------------------------------ server
    @property
    def _server_bn(self) -> bool:
        return bool(self.hparams["static_bn"]) and self.hparams["sbn_statistics"] == "server"

    def _broadcast(self, state, round_: int) -> Payload:
        tensors = dict(state["global"])
        meta = {"round": int(round_), "layout": state["layout"]}
        if "sbn" in state:  # static BN's server statistics, per model: "sbn.<i>.<key>", model i of meta["sbn"]
            keys = sorted(state["sbn"])
            for i, model_key in enumerate(keys):
                tensors.update({f"sbn.{i}.{k}": t for k, t in state["sbn"][model_key].items()})
            meta["sbn"] = json.dumps(keys)
        return Payload(tensors, meta)

    def _calibration_batches(self, server: ServerContext) -> list[torch.Tensor]:
        pool = server.public_images
        if pool is None or len(pool) == 0:
            raise UserInputError(f"{self.name} with sbn_statistics: server measures BN statistics on the server's public "
                                 "pool, and this run has none; set partition.public_fraction > 0, or sbn_statistics: local",
                                 field="algorithm.sbn_statistics")
        calib = pool[torch.as_tensor(calibration_sample(torch.arange(len(pool)).numpy(), CALIBRATION_IMAGES))]
        return [calib[i:i + CALIBRATION_BATCH] for i in range(0, len(calib), CALIBRATION_BATCH)]

    def server_bn_statistics(self, global_state: dict[str, torch.Tensor], layout_json: str, round_: int,
                             server: ServerContext) -> dict[str, dict[str, torch.Tensor]]:
        """Static BN's ``server`` statistics of every client model's slice of ``global_state``.

        BN recalibration (:func:`rafl.supernet.model.recalibrate_bn`; OFA, Cai et al., ICLR 2020,
        Sec. 3.2) of each model's slice on the fixed class-mixed sample of 512 public images the
        searched subnets are recalibrated on, with the model's scaler as it evaluates.

        Args:
            global_state: the global model (the server state's ``"global"``).
            layout_json: the server state's ``"layout"``.
            round_: the round the slices are cut for (FedRolex's window; the broadcast's round).
            server: the server context (clients, ``make_model``, ``public_images``, device).

        Returns:
            model key -> {BN state-dict key -> running mean ``(C,)`` / var ``(C,)`` / counter}.

        Raises:
            UserInputError: the run has no public pool (``algorithm.sbn_statistics``).
        """
        batches = self._calibration_batches(server)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for c in server.clients:
            if c.model_key in out:
                continue
            index = index_map(layout_json, c, round_, self.rolling)
            model = server.make_model(arch=c.arch) if c.arch is not None else server.make_model(client_id=c.client_id)
            model.load_state_dict(extract(global_state, index, [k for k in index if self._sent(k)]), strict=False)
            set_scalers(model, bool(self.hparams["scaler"]))
            recalibrate_bn(model, batches, n_batches=None, device=server.device)
            out[c.model_key] = {k: t for k, t in cpu_state(model).items() if is_bn_stat(k)}
        return out

    def _state(self, global_state, layout_json: str, round_: int, server: ServerContext) -> dict[str, Any]:
        state: dict[str, Any] = {"global": global_state, "layout": layout_json}
        if self._server_bn:
            state["sbn"] = self.server_bn_statistics(global_state, layout_json, round_, server)
        return state

    def init_server(self, server: ServerContext):
        layout, global_state = self.layout(server)
        state = self._state(global_state, json.dumps(layout, sort_keys=True), 1, server)
        return state, self._broadcast(state, 1)

    def _sent(self, key: str) -> bool:
        return not is_kernel_matrix(key) and not (self.hparams["static_bn"] and is_bn_stat(key))

    def client_broadcast(self, broadcast: Payload, client: ClientInfo) -> Payload:
        index = index_map(str(broadcast.meta["layout"]), client, int(broadcast.meta["round"]), self.rolling)
        keys = [k for k in index if self._sent(k)]
        tensors = extract(broadcast.tensors, index, keys)
        if "sbn" in broadcast.meta:  # the client's model's server-measured static BN statistics
            prefix = f"sbn.{json.loads(str(broadcast.meta['sbn'])).index(client.model_key)}."
            tensors.update({k[len(prefix):]: t for k, t in broadcast.tensors.items() if k.startswith(prefix)})
        return Payload(tensors, {"round": int(broadcast.meta["round"])})

    def upload_spec(self, server_state, client: ClientInfo):
        index = index_map(server_state["layout"], client, 1, self.rolling)
        return {k: tuple(v[1].shape) for k, v in index.items() if self._sent(k)}

    def server_aggregate(self, uploads, server_state, server: ServerContext):
        rnd = int(server.round)
        held = []
        for u in uploads:
            info = server.clients[int(u.meta["client_id"])]
            weight = float(info.n_samples) if self.hparams["weighting"] == "samples" else 1.0
            if weight <= 0:
                continue  # a client without training samples trains nothing
            held.append((u.tensors, index_map(server_state["layout"], info, rnd, self.rolling), weight))
        new = masked_average(server_state["global"], held, getattr(server, "aggregation", None)) if held \
            else server_state["global"]
        state = self._state(new, server_state["layout"], rnd + 1, server)
        return state, self._broadcast(state, rnd + 1)

    # ------------------------------------------------------------------ client
    def _model(self, client: ClientContext, weights):
        model = client.make_model()
        missing, unexpected = model.load_state_dict(dict(weights), strict=False)
        bad = [k for k in missing if not is_bn_stat(k)] + list(unexpected)
        if bad:
            raise UserInputError(f"the downloaded slice does not fit the client's model ({bad[:3]}); allowed: the "
                                 "model the run was started with")

        set_scalers(model, bool(self.hparams["scaler"]))
        return model.to(client.device).train()

    def init_client(self, client: ClientContext):
        return {}

    def _start(self, state, broadcast: Payload) -> dict[str, torch.Tensor]:
        """The client's slice as downloaded, with its own BN layers under FedBN (``train.bn_statistics: local``)."""
        weights = dict(broadcast.tensors)
        return with_own_bn(weights, state.get("bn")) if self.bn_policy == "local" else weights

    def client_update(self, state, broadcast: Payload, client: ClientContext):
        hp = self.hparams
        model = self._model(client, self._start(state, broadcast))
        train_ce(model, client.train_loader, optimizer_for(model, hp), epochs=hp["local_epochs"], device=client.device,
                 bn_recalibration=False)
        upload = {k: v for k, v in cpu_state(model).items() if self._sent(k)}
        return ({"bn": own_bn(model)} if self.bn_policy == "local" else {}), Payload(upload, {"n_samples": client.n_samples})

    def prepare_evaluation(self, state, broadcast: Payload, client: ClientContext):
        return {"model": self._start(state, broadcast)}

    def evaluate(self, state, client: ClientContext):
        model = self._model(client, state["model"])
        carried = any(is_bn_stat(k) for k in state["model"])  # a broadcast under server statistics carries them
        if self.hparams["static_bn"] and not (self._server_bn and carried):
            recalibrate_local_bn(model, client.train_loader, device=client.device)
        return eval_counts(DEPLOYED.prefix, *evaluate_accuracy(model, client.test_loader, device=client.device))

    # ------------------------------------------------------------------ the federated supernet
    def federated_supernet(self, server_state, server: ServerContext):
        """The server's global model as a :class:`rafl.supernet.Supernet` (NAS runs), or None."""
        layout = json.loads(server_state["layout"])
        if layout["kind"] != "nas":
            return None

        net = build_supernet(server.space)
        net.load_state_dict(server_state["global"])
        return net.eval()


__all__ = ["HeteroFL", "index_map", "is_bn_stat"]
