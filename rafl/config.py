"""The validated run configuration of ``rafl federate``: one source of truth for every default.

A run config is YAML (``--config run.yaml``) merged over these defaults, then ``--set key=value``
dotted overrides (values parsed as YAML: ``--set engine.rounds=5``, ``--set
clients.profiles=[pi4,phone]``). Validation is pydantic v2 with ``extra="forbid"`` everywhere
except ``algorithm`` (whose keys the algorithm registry checks against the chosen method's
hyperparameter model: :func:`rafl.federation.run_config.load_run_config`), so a misspelt key is an
error, never silently ignored. This module is pure pydantic: it knows no algorithm. The resolved config (all defaults filled in)
is saved in the run dir as ``config.yaml`` and reproduces the run.

Example (every key optional)::

    seed: 0
    data: {dataset: digits, resolution: 32, limit_per_class: null, root: null}
    partition: {scheme: dirichlet, alpha: 0.5, public_fraction: 0.3, public_seed: 0}
    clients: {n: 10, profiles: [pi4, jetson-nano, phone]}
    supernet: {path: null}                # null = the cached quickstart supernet
    search: {method: evolution, population: 24, generations: 10}
    algorithm: {name: rafl, local_epochs: 2, temperature: 1.0}
    engine: {rounds: 10, clients_per_round: 1.0, dropout: 0.0, eval_every: 1}
    train: {batch_size: 32, device: cpu}
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rafl.data.partition import SCHEMES, validate_split
from rafl.errors import DuplicateKeyError, UserInputError, shown, warn, yaml_error_detail
from rafl.io import load_yaml, read_text_file
from rafl.schema import NoBoolNumbers
from rafl.search.profile import DeviceProfile, load_profile, names_a_file, profiles_dir
from rafl.supernet.pretrained import is_pretrained_name

#: the largest seed (numpy's legacy seeding bound; the methods derive per-round generator seeds such
#: as ``seed * 100003 + round`` from it, which must stay below torch's 2**63)
SEED_MAX = 2**32 - 1


class _Strict(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    """Which dataset (see :func:`rafl.data.load_dataset`)."""

    dataset: Literal["digits", "cifar10", "cifar100", "femnist"] = "digits"
    root: str | None = Field(None, description="dataset root / archive path, or null (the default location)")
    resolution: int = Field(32, ge=8, le=224, description="an integer in 8..224 (pixels)")
    limit_per_class: int | None = Field(None, ge=1, description="an integer >= 1 or null (all samples)")


class PartitionConfig(_Strict):
    """How the data is split over clients (see :func:`rafl.data.make_partition`)."""

    scheme: str = Field("dirichlet", description="iid, pathological, dirichlet, balanced-dirichlet, natural or "
                        "file:PATH")
    alpha: float | None = Field(0.5, gt=0, description="a number > 0 (dirichlet, balanced-dirichlet)")
    k: int | None = Field(None, ge=1, description="an integer >= 1 (pathological: classes per client)")
    min_samples: int = Field(10, ge=1, description="an integer >= 1")
    public_fraction: float = Field(0.3, ge=0, lt=1, description="a fraction in [0, 1)")
    public_seed: int = Field(0, ge=0, le=SEED_MAX, description=f"an integer in 0..{SEED_MAX} (seed of the public pool)")
    global_test_per_class: int = Field(
        0, ge=0, le=100_000, description="an integer in 0..100000: samples per class of the source's test split held "
        "out as a balanced global test set (no client and no supernet sees it; every deployed model is also scored "
        "on it, as model@global); 0 = none")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description=f"an integer in 0..{SEED_MAX} or null (= the run seed)")
    split: tuple[float, float, float] = Field(
        (0.8, 0.1, 0.1), description="three fractions train > 0, val >= 0, test >= 0 summing to 1, e.g. [0.8, 0.1, 0.1]")

    @field_validator("split")
    @classmethod
    def _split(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        try:
            return validate_split(v)  # the partitioner's own rule
        except UserInputError:
            raise ValueError("not a valid split") from None

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if v not in SCHEMES and not v.startswith("file:"):
            raise ValueError(f"allowed: {', '.join(SCHEMES)}, file:PATH")
        return v


class ClientsConfig(_Strict):
    """The client population: how many, their device profiles, optional fixed archs, or a
    heterogeneous model group instead of supernet subnets.

    ``profiles`` are assigned round-robin to clients 0..n-1 (or give exactly ``n`` entries).
    ``archs`` maps a profile name to a fixed subnet (arch string or arch YAML/JSON path), which
    then replaces the search for that profile; ``arch`` gives one arch to every client
    (homogeneous population, e.g. for FedAvg). ``budgets`` replaces some budgets of a profile for
    this run (same device, another application: e.g. ``{pi4: {latency_ms: 1.2}}``); none by
    default (the shipped profiles' own budgets bind on the shipped supernets' 12-32 px subnets).
    ``subnets: weakest`` puts every client on the one subnet that fits every profile (what
    ``uniform`` deploys) for any method: the ablation of tailoring a subnet to each device.
    ``models`` other than ``nas`` gives client ``i`` member ``i % len(members)`` of a model group
    (:func:`rafl.models.resolve_models`: the FedTGP paper's HtFE groups, zoo names, plug-ins), each
    with a feature extractor of width ``feature_dim`` and its own header; no supernet, profile or
    search is used then.
    """

    n: int = Field(10, ge=1, description="an integer >= 1")
    profiles: list[str] = Field(["pi4", "jetson-nano", "phone"], min_length=1,
                                description="a non-empty list of profile names or paths")
    archs: dict[str, str] = Field(default_factory=dict, description="profile name -> arch string or file")
    arch: str | None = Field(None, description="one arch (string or file) for every client, or null")
    budgets: dict[str, dict[str, float | None]] = Field(
        default_factory=dict,
        description="profile name -> {budget name: limit} overrides")
    models: str = Field("nas", min_length=1,
                        description="nas (a searched subnet of the supernet per device profile) or a model group: "
                                    "htfe4, htfe8, htfe-tiny, model names or package.module:factory plug-ins, "
                                    "comma-separated, assigned round-robin")
    feature_dim: int = Field(128, ge=1, le=4096,
                             description="an integer 1..4096 (the model group's common representation width D; "
                                         "nas keeps the supernet's; FedTGP's server network holds D x D weights)")
    subnets: Literal["per-device", "weakest"] = Field(
        "per-device", description="per-device (each profile's own searched subnet) or weakest (every client on the "
        "subnet that fits every profile, the weakest device's: the tailoring ablation; nas only)")
    held_out_fraction: float = Field(
        0.0, ge=0, le=0.5, description="0 (off) or a fraction in (0, 0.5]: that share of the clients (round(n x "
        "fraction), spread over the device tiers) never trains and is scored at the end on the final federated "
        "model(s) of its tier, as deployed and after one local fine-tune (the new-clients protocol; nas only)")

    def held_out_count(self) -> int:
        """How many of the ``n`` clients are held out: ``floor(n x held_out_fraction + 0.5)`` (0: off)."""
        return int(self.n * self.held_out_fraction + 0.5) if self.held_out_fraction > 0 else 0


class SupernetConfig(_Strict):
    """Which supernet: a checkpoint path, a shipped supernet's name (``cifar10``), or null for the
    cached quickstart supernet. ``supernet: cifar10`` is short for ``supernet: {path: cifar10}``."""

    path: str | None = Field(None, description="a supernet checkpoint (dir or file), a shipped name (cifar10), "
                                               "or null (quickstart)")


class SearchSection(_Strict):
    """Per-profile subnet search (:func:`rafl.search.evolution.search_subnets`)."""

    method: Literal["evolution", "largest-feasible"] = Field(
        "evolution", description="evolution (the search) or largest-feasible (random sampling, by MACs)")
    population: int = Field(24, ge=2, description="an integer >= 2")
    generations: int = Field(10, ge=0, description="an integer >= 0")
    estimator: Literal["predictor", "measured"] = "predictor"
    predictor_samples: int = Field(16, ge=4, description="an integer >= 4")
    top_k: int = Field(2, ge=1, description="an integer >= 1")
    val_samples: int = Field(256, ge=8, description="an integer >= 8 (public-pool images for validation)")
    samples: int = Field(2000, ge=1, description="an integer >= 1 (largest-feasible: random archs tried)")


class AlgorithmConfig(BaseModel):
    """The FL method and its hyperparameters (keys checked against the method's defaults)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("rafl", description="a registered algorithm name")

    def hparams(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class EngineSection(_Strict):
    """Rounds, participation and faults (run by :class:`rafl.federation.engine.Engine` as :class:`EngineConfig`)."""

    rounds: int = Field(10, ge=1, description="an integer >= 1")
    clients_per_round: float | int = Field(1.0, gt=0, description="a fraction in (0, 1] or a count >= 1")
    available: float | int = Field(1.0, gt=0, description="a fraction in (0, 1] or a count >= 1")
    sporadic_rate: float = Field(0.0, ge=0, lt=1, description="a fraction in [0, 1)")
    dropout: float = Field(0.0, ge=0, lt=1, description="a probability in [0, 1)")
    eval_every: int = Field(1, ge=1, description="an integer >= 1")
    eval_clients: Literal["all", "sampled"] = "all"
    target_accuracy: float | None = Field(0.8, ge=0, le=1, description="a fraction in [0, 1] or null")
    backend: Literal["in-process", "flower"] = Field(
        "in-process", description="in-process (clients run one after the other in this process) or flower "
        "(Flower's Simulation Runtime: every client step a ClientApp on a virtual SuperNode; needs rafl[flower])")
    supernodes: int | None = Field(None, ge=1, description="an integer in 1..clients.n (flower: virtual SuperNodes "
                                   "of the Simulation Runtime; null = one per client; ignored in-process)")
    workers: int | None = Field(None, ge=1, description="an integer >= 1 (in-process: processes running the "
                                "sampled clients' steps and the evaluation, one torch thread each; results are the "
                                "same for every value) or null (the CPU cores not kept busy by other processes (the load "
                                "average), at most the clients sampled per round)")
    round_timeout_s: float = Field(600.0, gt=0, description="seconds > 0 (flower: a node that has not replied by "
                                   "then loses its clients for the round; raise it for slow devices or many clients "
                                   "per node)")
    aggregation: Literal["mean", "median", "trimmed_mean", "norm_clip"] = Field(
        "norm_clip", description="norm_clip (every client's update clipped to an L2 norm, Sun et al. 2019; per-class "
        "vectors to their class's median norm), mean (sample-weighted, unbounded), median or trimmed_mean "
        "(coordinate-wise, Yin et al. 2018): how the server merges uploads")
    trim_fraction: float = Field(0.1, ge=0, lt=0.5, description="a fraction in [0, 0.5) (trimmed_mean: the share "
                                 "of largest and of smallest values dropped per coordinate)")
    clip_norm: float | None = Field(None, gt=0, allow_inf_nan=False, description="a number > 0 or null (norm_clip: the L2 bound of an "
                                    "update; null = the median update norm of the round)")
    max_upload_mb: float | None = Field(None, gt=0, allow_inf_nan=False, description="a number > 0 (MB) or null (twice the expected "
                                        "float32 size + 1 MiB; 16 MiB for per-class uploads)")
    max_abs_value: float = Field(1e6, gt=0, allow_inf_nan=False, description="a number > 0 (the largest |value| of an uploaded float)")
    min_valid_uploads: int = Field(1, ge=1, description="an integer >= 1 (fewer valid uploads: the round fails "
                                   "and changes no state)")

    @field_validator("clients_per_round", "available")
    @classmethod
    def _share_or_count(cls, v: float | int) -> float | int:
        """A fraction in (0, 1] or a whole count >= 1 (1.5 clients is neither), as the engine needs."""
        if isinstance(v, float) and v > 1:
            if not v.is_integer():
                raise ValueError("neither a fraction nor a whole count")
            return int(v)
        return v


class EngineConfig(EngineSection):
    """What :class:`rafl.federation.engine.Engine` runs on: the run config's ``engine`` section
    (same fields, defaults and checks) and the run seed."""

    seed: int = Field(0, ge=0, le=SEED_MAX, description=f"an integer in 0..{SEED_MAX} (the run seed)")

    @classmethod
    def of(cls, cfg: RunConfig) -> EngineConfig:
        """``cfg``'s engine section and seed (both validated with ``cfg``: not checked again)."""
        return cls.model_construct(**dict(cfg.engine), seed=cfg.seed)


class TrainSection(_Strict):
    """Local computation."""

    batch_size: int = Field(32, ge=2, description="an integer >= 2 (train-mode BatchNorm needs two samples per batch)")
    device: str = Field("cpu", description="cpu, cuda or cuda:N (a CUDA device this machine has)")
    threads: int | None = Field(1, ge=1, description="torch CPU threads (default 1: the small subnets gain little from intra-op "
                                   "threads, and lose a lot on a shared CPU), or null (torch's default)")
    bn_statistics: Literal["client", "server", "local"] | None = Field(
        None, description="client, server, local or null: where the BatchNorm statistics of every deployed model come "
        "from -- re-estimated on the client's own training split (client), on the server's public pool (server), or "
        "FedBN's local BN layers, never averaged (local); null: the method's own rule (averaged for fedavg, fedprox, "
        "fednova, uniform, heterofl, fedrolex, feddf; client for standalone, fedgh, fedtgp, fedproto, rafl; server "
        "for pretrained; pooled for centralized)")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        """A device torch can parse and this machine has (a CUDA device on a machine without one
        would otherwise fail mid-run with torch's "Found no NVIDIA driver")."""
        import torch  # noqa: PLC0415 - a check module: torch only for a device other than cpu

        try:
            dev = torch.device(v)
        except (RuntimeError, TypeError):
            raise ValueError("not a torch device") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("no CUDA device is available on this machine (use cpu)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"this machine has {torch.cuda.device_count()} CUDA device(s)")
        elif dev.type != "cpu":
            raise ValueError(f"device type {dev.type!r} is not supported")
        return v


class RunConfig(_Strict):
    """The whole ``rafl federate`` run (see the module docstring)."""

    seed: int = Field(0, ge=0, le=SEED_MAX, description=f"an integer in 0..{SEED_MAX}")
    name: str | None = Field(None, description="run dir name under --out, or null (algorithm-timestamp)")
    data: DataConfig = Field(default_factory=DataConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    clients: ClientsConfig = Field(default_factory=ClientsConfig)
    supernet: SupernetConfig = Field(default_factory=SupernetConfig)
    search: SearchSection = Field(default_factory=SearchSection)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    engine: EngineSection = Field(default_factory=EngineSection)
    train: TrainSection = Field(default_factory=TrainSection)

    @model_validator(mode="before")
    @classmethod
    def _supernet_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("supernet"), str):  # supernet: cifar10
            data = {**data, "supernet": {"path": data["supernet"]}}
        return data

    @model_validator(mode="after")
    def _held_out(self) -> RunConfig:
        """A held-out share that holds out at least one client and leaves at least one to train."""
        c = self.clients
        if c.held_out_fraction > 0 and not 1 <= c.held_out_count() <= c.n - 1:
            raise ValueError(f"clients.held_out_fraction {c.held_out_fraction} of clients.n={c.n} holds out "
                             f"{c.held_out_count()} client(s); allowed: 0 (off) or a fraction in (0, 0.5] that holds "
                             f"out 1..{max(c.n - 1, 0)} of the {c.n} clients")
        return self

    @model_validator(mode="after")
    def _server_statistics_need_a_pool(self) -> RunConfig:
        """``train.bn_statistics: server`` re-estimates on the server's public pool: a run without one
        is refused here, before any data is read (the run would refuse it after building)."""
        if self.train.bn_statistics == "server" and self.partition.public_fraction == 0:
            raise ValueError("train.bn_statistics is server (statistics re-estimated on the server's public pool) "
                             "and partition.public_fraction is 0 (no pool); allowed: train.bn_statistics client, "
                             "local or null, or partition.public_fraction > 0")
        return self

    def resolved(self) -> dict[str, Any]:
        """Plain dict with every default filled in (what ``config.yaml`` holds)."""
        out = self.model_dump(mode="json")
        alg = out.pop("algorithm")
        out["algorithm"] = alg
        return out


def _set_dotted(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    if len(parts) > 1 and parts[0] == "supernet" and isinstance(data.get("supernet"), str):
        data["supernet"] = {"path": data["supernet"]}  # the shorthand `supernet: cifar10` is its section
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise UserInputError(f"{'.'.join(parts[:parts.index(p) + 1])} is not a section", source=source,
                                 field=key)
        node = nxt
    node[parts[-1]] = value


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """``["engine.rounds=5", ...]`` -> ``[("engine.rounds", 5), ...]`` (values parsed as YAML).

    Raises:
        UserInputError: an item without ``=`` or with an empty key.
    """
    out = []
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise UserInputError(f"{item!r} is not key=value (e.g. engine.rounds=5)", field="--set")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        except DuplicateKeyError as err:
            raise UserInputError(f"{item!r}: {err.message}", field="--set") from None
        if isinstance(value, dict) and list(value.values()) == [None] and raw.strip().endswith(":"):
            # YAML reads "pkg.mod:" as the mapping {pkg.mod: null}; a value cut short after its colon
            # is meant as text, and its own field's check then says what is missing
            value = raw.strip()
        out.append((key.strip(), value))
    return out


def blame(field: str | None, set_keys: Iterable[str], file_source: str | None) -> str | None:
    """What an error on ``field`` should name: ``--set`` when a ``--set`` key wrote that field, a
    section holding it or a key inside it; else ``file_source`` (the config file, or None)."""
    if field:
        for key in set_keys:
            if field == key or field.startswith(key + ".") or key.startswith(field + "."):
                return "--set"
    return file_source


def _error(err: ValidationError, source: str | None) -> UserInputError:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    # a union field (e.g. clients_per_round: float | int) adds the member it tried: not part of the key
    loc = [p for p in loc if p not in ("float", "int", "str", "bool", "none")
           and not p.startswith(("list[", "dict[", "tuple[", "function-"))]
    # walk the models to find the field's description (its allowed values)
    model: Any = RunConfig
    info = None
    for p in loc:
        fields = getattr(model, "model_fields", {})
        if p not in fields:
            info = None
            break
        info = fields[p]
        model = info.annotation
    if first.get("type") == "extra_forbidden":
        parent: Any = RunConfig
        for p in loc[:-1]:
            parent = parent.model_fields[p].annotation
        allowed = ", ".join(parent.model_fields)
        return UserInputError(f"unknown key; allowed: {allowed}", source=source, field=".".join(loc))
    if first.get("type") == "model_type" and isinstance(model, type) and hasattr(model, "model_fields"):
        # a section given a scalar, e.g. --set engine=5: say what the section holds
        return UserInputError(f"is {shown(first.get('input'))}; allowed: a mapping of the section's keys "
                              f"({', '.join(model.model_fields)})", source=source, field=".".join(loc))
    hint = f"; allowed: {info.description}" if info is not None and info.description else ""
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return UserInputError(f"{msg} (got {shown(first.get('input'))}){hint}", source=source, field=".".join(loc))


def read_config_file(path: str | Path | None) -> dict[str, Any]:
    """The top-level mapping of a YAML run config (``{}`` for None or an empty file).

    Raises:
        UserInputError: a missing file, invalid YAML, or a top level that is not a mapping.
    """
    if path is None:
        return {}
    p = Path(path)
    if p.is_dir():
        raise UserInputError("is a folder; expected a YAML run config file", source=p)
    if not p.is_file():
        raise UserInputError("no such file (expected a YAML run config)", source=p)
    try:
        data = load_yaml(read_text_file(p), p) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserInputError(yaml_error_detail(err), source=p) from None
    if not isinstance(data, dict):
        raise UserInputError("expected a mapping at the top level", source=p)
    return data


def is_compare_record(data: Any) -> bool:
    """Whether a parsed YAML document is the ``config.yaml`` ``rafl compare`` writes into its folder
    (it lists ``algorithms``: every method's resolved hyperparameters)."""
    return isinstance(data, dict) and "algorithms" in data


def reject_compare_record(data: dict[str, Any], path: str | Path | None) -> None:
    """Refuse the ``config.yaml`` that ``rafl compare`` writes into its folder (it lists
    ``algorithms``: every method's resolved hyperparameters) where a run config is expected.

    Raises:
        UserInputError: naming the file and the command that continues that comparison.
    """
    if path is not None and is_compare_record(data):
        folder = shlex.quote(str(Path(path).parent))
        raise UserInputError("is the record rafl compare keeps in its folder, not a run config; continue that "
                             f"comparison with: rafl compare --resume {folder} (a run config has the keys of "
                             "rafl/config.py: data, partition, clients, supernet, algorithm, engine, ...)",
                             source=path, field="algorithms")


def section_keys_that_apply(method_key: str, section: dict[str, Any], set_keys: Iterable[str]) -> dict[str, Any]:
    """The keys of a method's own section ``algorithm.<method_key>`` that apply over the shared
    ``algorithm.*`` keys: all, except one whose shared key was given with ``--set`` while the
    section's value came from the file (the command line wins over the file). One rule for
    ``rafl federate`` and ``rafl compare``."""
    given = set(set_keys)
    return {k: v for k, v in section.items()
            if not (f"algorithm.{k}" in given and f"algorithm.{method_key}.{k}" not in given)}


def merge_method_sections(data: dict[str, Any], set_keys: list[str], source: str | None,
                          methods: Mapping[str, str]) -> dict[str, str]:
    """``rafl compare``'s per-method sections in a run config (``algorithm: {lr: 0.05, fedtgp:
    {tau: 5}}``), so one file serves ``rafl compare`` and ``rafl federate``: the selected method's
    section applies over the shared keys (as in compare), except over a shared key given with
    ``--set`` (the command line wins over the file); other methods' sections are ignored, but
    a ``--set`` into one is a slip. ``methods`` maps every registered method name (lower case) to
    the name it is registered under. Edits ``data`` in place; returns ``{"algorithm.tau":
    "algorithm.fedtgp.tau"}`` for the keys it moved, so errors name them as written.

    Raises:
        UserInputError: the selected method's section is not a mapping, or ``--set`` writes into
            the section of a method that ``algorithm.name`` does not select.
    """
    algo = data.get("algorithm")
    if not isinstance(algo, dict):
        return {}
    sections = [k for k in algo if isinstance(k, str) and k != "name" and k.lower() in methods]
    selected = methods.get(str(algo.get("name", AlgorithmConfig.model_fields["name"].default)).strip().lower())
    if selected is None:
        return {}  # the unknown name gets its own error
    moved: dict[str, str] = {}
    for k in sections:
        section = algo.pop(k)
        if methods[k.strip().lower()] != selected:
            slip = next((s for s in set_keys if s == f"algorithm.{k}" or s.startswith(f"algorithm.{k}.")), None)
            if slip is not None:
                raise UserInputError(f"sets a hyperparameter of {k}, which algorithm.name does not select "
                                     f"(selected: {selected})", source="--set", field=slip)
            continue
        if section is None:  # an empty section in the file (`fedtgp:`)
            continue
        if not isinstance(section, dict):
            raise UserInputError(f"is {shown(section)}; allowed: a mapping of {selected}'s hyperparameters",
                                 source=blame(f"algorithm.{k}", set_keys, source), field=f"algorithm.{k}")
        for key, value in section_keys_that_apply(k, section, set_keys).items():
            algo[key] = value
            moved[f"algorithm.{key}"] = f"algorithm.{k}.{key}"
    return moved


#: the run-config fields that hold a path (``partition.scheme`` as ``file:PATH``; ``clients.profiles``
#: a list whose entries are shipped names or YAML files)
PATH_FIELDS = ("supernet.path", "data.root", "partition.scheme", "clients.profiles")


def absolute_paths(cfg: RunConfig, file_base: Path, set_keys: Iterable[str] = ()) -> RunConfig:
    """``cfg`` with its relative paths (:data:`PATH_FIELDS`) made absolute: a value given with
    ``--set`` (a key in ``set_keys``) against the current folder, a value from the run YAML against
    ``file_base`` (the YAML's folder), as a YAML's own references are read everywhere else (the
    Flower App, a profile's ``latency_lut``). The run dir's ``config.yaml`` then names the same
    files whatever folder the run is resumed from."""
    given = set(set_keys)
    update: dict[str, Any] = {}
    for dotted in PATH_FIELDS:
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if dotted == "clients.profiles":  # profile files among shipped names (as load_profile tells them)
            base = Path.cwd() if dotted in given else file_base

            def entry(v: str) -> str:
                if not names_a_file(v):
                    return v
                here = base / Path(v).expanduser()
                if not here.exists() and "/" not in v and (profiles_dir() / v).is_file():
                    return Path(v).stem  # `pi4.yaml` names the shipped profile: recorded as `pi4`
                return str(here.resolve())

            new_list = [entry(v) for v in value]
            if new_list != list(value):
                update[section] = update.get(section, getattr(cfg, section)).model_copy(update={key: new_list})
            continue
        if not isinstance(value, str) or not value:
            continue
        if dotted == "supernet.path":
            if is_pretrained_name(value):  # a shipped supernet's name, not a path
                continue
        prefix = "file:" if dotted == "partition.scheme" else ""
        if prefix and not value.startswith(prefix):
            continue
        raw = Path(value[len(prefix):]).expanduser()
        if raw.is_absolute() and raw == Path(value[len(prefix):]):
            continue
        base = Path.cwd() if dotted in given else file_base
        new = prefix + str((base / raw).resolve())
        update[section] = update.get(section, getattr(cfg, section)).model_copy(update={key: new})
    return cfg.model_copy(update=update) if update else cfg


@dataclass(frozen=True)
class ConfigSource:
    """Where a run config's values came from, so an error names what the user wrote.

    Attributes:
        path: the YAML file, or None (defaults and ``--set`` only).
        set_keys: the dotted keys given with ``--set``, in order.
        moved: ``{"algorithm.tau": "algorithm.fedtgp.tau"}``: the keys taken from the selected
            method's own section (:func:`merge_method_sections`).
    """

    path: str | None = None
    set_keys: tuple[str, ...] = ()
    moved: Mapping[str, str] = field(default_factory=dict)

    def error(self, err: UserInputError) -> UserInputError:
        """``err`` (from a check of the loaded config) naming its field as written -- a key from
        the method's own section as ``algorithm.<method>.<key>`` -- and ``--set`` or the file as
        its source."""
        name = err.field or "algorithm"
        name = self.moved.get(name, name)
        return UserInputError(err.message, source=blame(name, self.set_keys, self.path), field=name)


def read_run_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                    base: str | Path | None = None, methods: Mapping[str, str] | None = None
                    ) -> tuple[RunConfig, ConfigSource]:
    """Defaults <- YAML file ``path`` <- ``--set`` overrides, validated by :class:`RunConfig`; the
    ``algorithm`` section holds the method's name and hyperparameters as given (checking them is
    the registry's part: :func:`rafl.federation.run_config.load_run_config`). ``methods``: the
    registered method names (lower case -> registered name) whose sections
    :func:`merge_method_sections` merges. Relative paths are made absolute
    (:func:`absolute_paths`): from the file against ``base`` (default: the file's folder), from
    ``--set`` against the current folder.

    Returns:
        ``(config, source)``: ``source`` says where each value came from (:class:`ConfigSource`).

    Raises:
        UserInputError: unreadable/malformed YAML, an unknown key outside ``algorithm``, a value
            out of range, fields that contradict each other (:func:`check_cross_fields`) -- naming
            the file and the dotted field and listing the allowed values.
    """
    data = read_config_file(path)
    reject_compare_record(data, path)
    source = None if path is None else str(path)
    parsed = parse_overrides(list(overrides))
    for key, value in parsed:
        _set_dotted(data, key, value, "--set")
    set_keys = [key for key, _ in parsed]
    moved = merge_method_sections(data, set_keys, source, methods or {})
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        e = _error(err, source)
        raise UserInputError(e.message, source=blame(e.field, set_keys, source), field=e.field) from None
    try:
        check_cross_fields(cfg)
    except UserInputError as e:
        raise UserInputError(e.message, source=blame(e.field, set_keys, source), field=e.field) from None
    file_base = Path(base) if base is not None else (Path(path).parent if path is not None else Path.cwd())
    return absolute_paths(cfg, file_base, set_keys), ConfigSource(source, tuple(set_keys), moved)


def _count(spec: float | int, n: int, name: str, of: str) -> int:
    if isinstance(spec, float) and 0 < spec <= 1:
        return max(1, int(math.ceil(spec * n - 1e-9)))
    if isinstance(spec, int) and not isinstance(spec, bool) and 1 <= spec <= n:
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool) and spec > n:
        raise UserInputError(f"is {spec}, more than the {n} {of}; allowed: a fraction in (0, 1] or a count "
                             f"in 1..{n}", field=f"engine.{name}")
    raise UserInputError(f"is {shown(spec)}; allowed: a fraction in (0, 1] or a count >= 1", field=f"engine.{name}")


def participation(engine: EngineSection, n_clients: int) -> tuple[int, int]:
    """``(available, sampled per round)`` client counts of an ``engine`` section for ``n_clients``
    clients.

    Raises:
        UserInputError: ``engine.available`` or ``engine.clients_per_round`` is not a fraction in
            (0, 1] or a count >= 1, or a count larger than the clients it picks from (the
            population, resp. the available clients).
    """
    available = _count(engine.available, n_clients, "available", "clients (clients.n)")
    return available, _count(engine.clients_per_round, available, "clients_per_round",
                             "available clients" if available < n_clients else "clients (clients.n)")


def check_cross_fields(cfg: RunConfig) -> None:
    """The checks of a run config that involve several fields and need neither data, a model nor
    the algorithm registry (each field alone is checked by its own model), so that
    :func:`read_run_config` answers them before any training, search or data decoding:

    - ``engine.available`` / ``engine.clients_per_round`` as counts within ``clients.n``
      (:func:`participation`);
    - ``engine.min_valid_uploads`` at most the clients sampled per round (else every round fails);
    - ``engine.supernodes`` at most ``clients.n`` with ``engine.backend: flower``;
    - ``partition.k`` given for ``partition.scheme: pathological``, ``partition.alpha`` for
      ``dirichlet``.

    Raises:
        UserInputError: naming the field at fault and its allowed values.
    """
    n = cfg.clients.n
    _, sampled = participation(cfg.engine, n)
    e = cfg.engine
    if e.min_valid_uploads > sampled:
        raise UserInputError(f"is {e.min_valid_uploads}, more than the {sampled} client(s) sampled per round "
                             "(engine.clients_per_round), so every round would fail; allowed: an integer in "
                             f"1..{sampled}", field="engine.min_valid_uploads")
    if e.backend == "flower" and e.supernodes is not None and e.supernodes > n:
        raise UserInputError(f"is {e.supernodes} but the run has {n} clients (clients.n); allowed: 1..{n} (virtual "
                             "SuperNode I hosts clients I, I+P, I+2P, ...), or null for one per client",
                             field="engine.supernodes")
    p = cfg.partition
    if p.scheme == "pathological" and p.k is None:
        raise UserInputError("is required for partition.scheme pathological (classes per client); allowed: "
                             f"{PartitionConfig.model_fields['k'].description}", field="partition.k")
    if p.scheme == "dirichlet" and p.alpha is None:
        raise UserInputError("is required for partition.scheme dirichlet (the concentration); allowed: "
                             f"{PartitionConfig.model_fields['alpha'].description}", field="partition.alpha")


def client_profiles(cfg: RunConfig) -> list[DeviceProfile]:
    """The device profiles of ``clients.profiles`` (shipped names or YAML files), each with its
    ``clients.budgets`` overrides applied, in order. Reads no dataset and loads no model (the
    commands call it before torch loads, so a misspelt profile answers at once).

    Raises:
        UserInputError: an unknown profile name (field ``clients.profiles``), a malformed
            profile file (naming the file and its field) or a bad budget override.
    """
    profiles = []
    for name in cfg.clients.profiles:
        try:
            profile = load_profile(name)
        except UserInputError as err:
            if err.source is not None:  # a profile file: name it and its field
                raise UserInputError(err.message, source=err.source, field=err.field) from None
            raise UserInputError(err.message, field="clients.profiles") from None
        if name in cfg.clients.budgets or profile.name in cfg.clients.budgets:
            overrides = cfg.clients.budgets.get(name, cfg.clients.budgets.get(profile.name, {}))
            profile = profile.with_budgets(overrides, source=f"clients.budgets.{name}")
        profiles.append(profile)
    return profiles


#: ``rafl.data.make_partition``'s field / ``rafl data`` option names -> the run config's keys
_PARTITION_FIELDS = {"k": "partition.k", "alpha": "partition.alpha", "min_samples": "partition.min_samples",
                     "n_clients": "clients.n", "clients": "clients.n", "public_fraction": "partition.public_fraction",
                     "split": "partition.split", "partition": "partition.scheme", "writers": "partition.scheme"}
_PARTITION_OPTIONS = {"--clients": "clients.n", "--min-samples": "partition.min_samples", "--k": "partition.k",
                      "--alpha": "partition.alpha", "--partition": "partition.scheme",
                      "--public-fraction": "partition.public_fraction"}


def partition_error(err: UserInputError, source: str | None = None) -> UserInputError:
    """``err`` from :func:`rafl.data.make_partition` restated in the run config's terms: its field
    (``k``, ``n_clients``, ...) and the ``rafl data`` options its hint names (``--clients``,
    ``--min-samples``) become ``partition.k``, ``clients.n``, ..., as in ``--set`` / ``--config``."""
    msg = re.sub(r"--[a-z-]+\b", lambda m: _PARTITION_OPTIONS.get(m.group(0), m.group(0)), err.message)
    field = _PARTITION_FIELDS.get(err.field or "", err.field)
    return UserInputError(msg, source=source if source is not None else err.source, field=field)


def warn_about_test_data(cfg: RunConfig, partition: Any) -> None:
    """Warn (stderr, once per message) when clients of ``partition`` hold no test data, so the
    accuracy is over fewer clients than the user thinks, or not measured at all: a split without a
    test share, or clients so small that their share of the test split rounds down to 0."""
    share = cfg.partition.split[2]
    if share == 0:
        warn(f"partition.split is {list(cfg.partition.split)}: the test share is 0, so no client accuracy is "
             "measured (tables show only communication and time); e.g. [0.75, 0.0, 0.25] keeps a quarter of each "
             "client's data for testing")
        return
    sizes = [len(c.test) for c in partition.clients]
    empty = sum(1 for n in sizes if n == 0)
    if empty == len(sizes):
        warn(f"no client holds a test sample (the {len(sizes)} clients are too small for the test share "
             f"{share}), so no accuracy is measured; use fewer clients (clients.n) or more data "
             "(data.limit_per_class)")
    elif empty:
        warn(f"{empty} of {len(sizes)} clients hold no test sample (too small for the test share {share}); "
             f"accuracy is the mean over the other {len(sizes) - empty}")


__all__ = ["warn_about_test_data", "partition_error", "RunConfig", "DataConfig", "PartitionConfig", "ClientsConfig",
           "SupernetConfig", "SearchSection", "AlgorithmConfig", "ConfigSource", "EngineConfig", "EngineSection",
           "TrainSection", "merge_method_sections", "read_run_config", "parse_overrides", "client_profiles",
           "check_cross_fields", "participation"]


def config_keys() -> dict[str, str]:
    """Every dotted key of the run config's sections (``engine.rounds``, ``clients.n``, ...) ->
    its allowed values (the field's description; for a ``Literal``, its values). The algorithm's
    hyperparameters depend on ``algorithm.name`` and are not listed (``rafl federate
    --list-algorithms`` shows them)."""
    out: dict[str, str] = {}
    for name, info in RunConfig.model_fields.items():
        model = info.annotation
        fields = getattr(model, "model_fields", None) if isinstance(model, type) else None
        if not fields:
            out[name] = _allowed_text(info)
            continue
        for key, sub in fields.items():
            out[f"{name}.{key}"] = _allowed_text(sub)
    return out


def _allowed_text(info: Any) -> str:
    if info.description:
        return info.description
    values = get_args(info.annotation)
    if values and all(isinstance(v, str) for v in values):
        return ", ".join(values)
    return ""


def commented_config(cfg: RunConfig) -> str:
    """``cfg`` resolved (every default filled in) as a YAML run config, one key a line with its
    allowed values as a comment: what ``rafl federate --show-config`` prints, loadable with
    ``--config``."""
    keys = config_keys()
    lines: list[str] = []

    def flow(value: Any) -> str:
        return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()

    for section, value in cfg.resolved().items():
        if not isinstance(value, dict):
            lines.append(f"{section}: {flow(value)}" + (f"   # {keys[section]}" if keys.get(section) else ""))
            continue
        lines.append(f"{section}:" + ("   # the method's hyperparameters: rafl federate --list-algorithms"
                                      if section == "algorithm" else ""))
        for key, v in value.items():
            note = keys.get(f"{section}.{key}", "")
            lines.append(f"  {key}: {flow(v)}" + (f"   # {note}" if note else ""))
    return "\n".join(lines) + "\n"
