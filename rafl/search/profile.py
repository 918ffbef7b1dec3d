"""Device profiles: what a device can do and the budgets a subnet must meet.

A profile is a YAML file validated by the pydantic model :class:`DeviceProfile`. Units are part of
every field name (``throughput_gmacs``, ``mem_bandwidth_gbs``, ``latency_ms`` ...). MACs and FLOPs
are never mixed: one multiply-add = 1 MAC = 2 FLOPs; throughputs are in GMAC/s.

Shipped profiles live in the top-level ``profiles/`` folder (installed as package data
``rafl.profiles``) and load by name (``load_profile("pi4")``); any other profile loads by path.

Example (``profiles/pi4.yaml``, abridged)::

    name: pi4
    description: Raspberry Pi 4 Model B, 4x Cortex-A72 @ 1.5 GHz, LPDDR4-3200
    throughput_gmacs: 4.0        # sustained fp32 conv throughput (source in the file)
    mem_bandwidth_gbs: 4.5
    layer_overhead_us: 50
    train_ram_mb: 2048
    energy_pj_per_mac: 150
    energy_pj_per_dram_byte: 100
    batch_size: 32
    epoch_samples: 500
    budgets:
      latency_ms: 1.5
      peak_memory_mb: 0.5

Bad input (unknown key, wrong type or unit, a budget <= 0, a missing field) raises one
:class:`rafl.errors.UserInputError` naming the file, the field and what is allowed.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rafl.errors import UserInputError, shown, yaml_error_detail
from rafl.io import load_yaml, read_text_file
from rafl.schema import NoBoolNumbers

#: the format tag of a latency LUT file (``format:``), written by
#: :func:`rafl.search.latency.build_latency_lut` and checked by every reader
LUT_FORMAT = "rafl-latency-lut/1"

__all__ = ["Budgets", "DeviceProfile", "load_profile", "list_profiles", "profiles_dir"]


class Budgets(NoBoolNumbers):
    """The limits a subnet must meet on the device. Every budget is optional and > 0.

    Attributes (all per image at batch 1 unless said otherwise):
        macs_m: multiply-accumulates of one forward pass, millions (conv + linear layers).
        params_m: parameters, millions.
        peak_memory_mb: peak live activation memory of inference at batch 1 (float32), MiB.
        train_memory_mb: training memory at the profile's ``batch_size`` (weights, gradients,
            SGD momentum, saved activations), MiB.
        latency_ms: predicted device latency of one image (batch 1), milliseconds.
        energy_mj: predicted energy of one inference (batch 1), millijoules.
        energy_per_epoch_j: predicted energy of one local training epoch over ``epoch_samples``
            samples (forward + backward = 3x the forward MACs), joules.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    macs_m: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False, description="a finite number > 0 and <= 1e9 (millions of MACs)")
    params_m: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False,
                                   description="a finite number > 0 and <= 1e9 (millions of parameters)")
    peak_memory_mb: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False, description="a finite number > 0 and <= 1e9 (MiB)")
    train_memory_mb: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False, description="a finite number > 0 and <= 1e9 (MiB)")
    latency_ms: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False,
                                     description="a finite number > 0 and <= 1e9 (milliseconds per image)")
    energy_mj: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False,
                                    description="a finite number > 0 and <= 1e12 (millijoules per image)")
    energy_per_epoch_j: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False,
                                             description="a finite number > 0 and <= 1e12 (joules per epoch)")

    def items(self) -> list[tuple[str, float]]:
        """The budgets that are set, as ``(name, limit)`` pairs, in field order."""
        return [(k, v) for k, v in self.model_dump().items() if v is not None]


class DeviceProfile(NoBoolNumbers):
    """A device: its capabilities (throughput, bandwidth, RAM, energy model) and its budgets.

    Capabilities feed the cost model (:class:`rafl.search.cost.CostModel`):

    * latency: per-layer roofline ``max(MACs / throughput, bytes / bandwidth) + layer overhead``
      (Williams et al., "Roofline", CACM 2009), or a measured per-layer lookup table
      (``latency_lut``, written by ``rafl profile --build-lut``; OFA, Cai et al. ICLR 2020, Sec. 3.3).
    * energy: ``MACs x energy_pj_per_mac + DRAM bytes x energy_pj_per_dram_byte`` (Horowitz,
      "Computing's energy problem", ISSCC 2014, Fig. 1.1.9), or ``avg_power_w x latency``.

    Raises:
        UserInputError: via :func:`load_profile` / :meth:`from_dict` for any invalid field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., min_length=1, description="a non-empty string")
    description: str = Field("", description="free text")
    throughput_gmacs: float = Field(..., ge=1e-6, le=1e9, allow_inf_nan=False,
                                    description="a finite number > 0, in 1e-6..1e9 (sustained fp32 GMAC/s on conv layers)")
    mem_bandwidth_gbs: float = Field(..., ge=1e-6, le=1e9, allow_inf_nan=False,
                                     description="a finite number > 0, in 1e-6..1e9 (sustained DRAM bandwidth, GB/s)")
    layer_overhead_us: float = Field(0.0, ge=0, le=1e9, allow_inf_nan=False,
                                     description="a finite number >= 0 and <= 1e9 (fixed cost per layer, microseconds)")
    train_ram_mb: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False,
                                       description="a finite number > 0 and <= 1e9 (RAM available for training, MiB)")
    energy_pj_per_mac: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False, description="a finite number > 0 and <= 1e9 (pJ per MAC)")
    energy_pj_per_dram_byte: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False,
                                                  description="a finite number > 0 and <= 1e9 (pJ per DRAM byte)")
    avg_power_w: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False,
                                      description="a finite number > 0 and <= 1e9 (average power while computing, W)")
    latency_lut: str | None = Field(None, min_length=1,
                                    description="a path to a YAML written by `rafl profile --build-lut`")
    batch_size: int = Field(32, gt=0, le=1024, strict=True,
                            description="an integer > 0 and <= 1024 (local training batch size)")
    epoch_samples: int = Field(500, gt=0, le=10**9, strict=True,
                               description="an integer > 0 and <= 10**9 (training samples per local epoch)")
    budgets: Budgets = Field(default_factory=Budgets, description="a mapping of budgets")

    # where the profile was read from (for relative latency_lut paths and messages); not a field
    _source: Path | None = None
    # budget name -> the setting that overrode it (with_budgets), e.g. "clients.budgets.pi4.macs_m"
    _budget_fields: dict[str, str] | None = None

    @model_validator(mode="after")
    def _check_energy_model(self) -> DeviceProfile:
        pj = (self.energy_pj_per_mac is not None, self.energy_pj_per_dram_byte is not None)
        if pj[0] != pj[1]:
            raise ValueError("energy_pj_per_mac and energy_pj_per_dram_byte go together: give both or neither")
        needs_energy = self.budgets.energy_mj is not None or self.budgets.energy_per_epoch_j is not None
        if needs_energy and not self.has_energy_model:
            raise ValueError("an energy budget needs an energy model: give energy_pj_per_mac + "
                             "energy_pj_per_dram_byte, or avg_power_w")
        return self

    @property
    def has_energy_model(self) -> bool:
        """True if energy can be predicted (pJ/MAC + pJ/byte, or average power)."""
        return self.energy_pj_per_mac is not None or self.avg_power_w is not None

    @property
    def source(self) -> Path | None:
        """The file this profile was loaded from (None if built in memory)."""
        return self._source

    def effective_budgets(self) -> list[tuple[str, float]]:
        """Budgets to check: the explicit ones, plus ``train_memory_mb = train_ram_mb`` when only
        the device's training RAM is given."""
        items = self.budgets.items()
        if self.budgets.train_memory_mb is None and self.train_ram_mb is not None:
            items.append(("train_memory_mb", self.train_ram_mb))
        return items

    def with_budgets(self, overrides: dict[str, Any], source: str | None = None) -> DeviceProfile:
        """A copy of this profile with some budgets replaced (same device, another application).

        Args:
            overrides: budget name -> new limit (a number > 0), or None to drop that budget.
            source: where the overrides came from (for error messages), e.g. a config key.

        Raises:
            UserInputError: an unknown budget name or an invalid value, naming ``source`` and the field.
        """
        data = self.model_dump()
        unknown = set(overrides) - set(Budgets.model_fields)
        if unknown:
            raise UserInputError(f"unknown budget(s) {sorted(unknown)}; allowed: "
                                 f"{', '.join(Budgets.model_fields)}", source=source)
        data["budgets"] = {**data["budgets"], **overrides}
        profile = DeviceProfile.from_dict(data, source=source or self._source)
        profile._source = self._source
        profile._budget_fields = {**(self._budget_fields or {}),
                                  **({k: f"{source}.{k}" for k in overrides} if source else {})}
        return profile

    def budget_field(self, key: str) -> str | None:
        """The setting that overrode budget ``key`` through :meth:`with_budgets` (e.g.
        ``clients.budgets.pi4.macs_m``), or None when the budget is the profile's own."""
        return (self._budget_fields or {}).get(key)

    def latency_lut_path(self) -> Path | None:
        """``latency_lut`` resolved relative to the profile file (or the working directory)."""
        if self.latency_lut is None:
            return None
        path = Path(self.latency_lut).expanduser()
        if not path.is_absolute() and self._source is not None:
            path = self._source.parent / path
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str | Path | None = None) -> DeviceProfile:
        """Validate a mapping (as read from YAML).

        Raises:
            UserInputError: one line naming ``source``, the field and what is allowed.
        """
        if not isinstance(data, dict):
            raise UserInputError("expected a mapping of profile fields "
                                 f"(allowed keys: {', '.join(cls.model_fields)})", source=source)
        try:
            profile = cls.model_validate(data)
        except ValidationError as err:
            raise _to_user_error(err, source) from None
        profile._source = Path(source) if source is not None else None
        return profile


def _field_info(loc: tuple) -> tuple[str, str]:
    """(dotted field name, allowed-values text) for a pydantic error location."""
    parts = [str(p) for p in loc]
    name = ".".join(parts)
    model: type[BaseModel] = DeviceProfile
    info = None
    for p in parts:
        fields = model.model_fields
        if p not in fields:
            info = None
            break
        info = fields[p]
        if p == "budgets":
            model = Budgets
    allowed_text = info.description if info is not None and info.description else ""
    return name, allowed_text


def _to_user_error(err: ValidationError, source: str | Path | None) -> UserInputError:
    """Turn pydantic's first error into one readable line."""
    first = err.errors()[0]
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        parent = loc[:-1]
        model = Budgets if parent == ("budgets",) else DeviceProfile
        return UserInputError(f"unknown key; allowed keys: {', '.join(model.model_fields)}",
                              source=source, field=".".join(str(p) for p in loc))
    if not loc:  # model-level validator
        msg = first.get("msg", "invalid").removeprefix("Value error, ")
        return UserInputError(msg, source=source)
    field, allowed_text = _field_info(loc)
    if kind == "missing":
        return UserInputError(f"missing required field; allowed: {allowed_text}", source=source, field=field)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return UserInputError(f"{msg} (got {shown(first.get('input'))}); allowed: {allowed_text}", source=source,
                          field=field)


def profiles_dir() -> Path:
    """The folder of shipped profiles (package data ``rafl.profiles``)."""
    return Path(str(importlib.resources.files("rafl.profiles")))


def list_profiles() -> list[str]:
    """Names of the shipped profiles (sorted), e.g. ``["jetson-nano", "mcu", "phone", "pi4", "server-gpu"]``."""
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def names_a_file(name_or_path: str | Path) -> bool:
    """Whether a ``clients.profiles`` / ``--device-profile`` entry is a YAML file rather than a
    shipped profile's name: a ``.yaml``/``.yml`` suffix, a ``/``, or an existing file."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    return path.suffix in (".yaml", ".yml") or "/" in text or path.is_file()


def shipped_file_name(name_or_path: str | Path) -> str | None:
    """The shipped profile's name (``"pi4"``) when ``name_or_path`` is a bare shipped file name
    (``"pi4.yaml"``, no folder) that does not exist in the current folder; else None. Such a name
    means the shipped profile (as a design card's ``--device-profile pi4.yaml`` does), from any folder."""
    text = str(name_or_path)
    if "/" in text or Path(text).expanduser().exists() or Path(text).suffix not in (".yaml", ".yml"):
        return None
    return Path(text).stem if (profiles_dir() / text).is_file() else None


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """Load a device profile by shipped name (``"pi4"``), by a shipped profile's file name
    (``"pi4.yaml"``, when the current folder holds no such file) or by path to a YAML file.

    Raises:
        UserInputError: unknown name (lists the shipped ones), unreadable/malformed YAML, or an
            invalid field (names the file, the field and what is allowed).
    """
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not names_a_file(text):
        shipped = profiles_dir() / f"{text}.yaml"
        if not shipped.is_file():
            raise UserInputError(f"unknown device profile {text!r}; shipped profiles: "
                                 f"{', '.join(list_profiles())} (or give a path to a YAML file)",
                                 field="device_profile")
        path = shipped
    if not path.is_file() and shipped_file_name(text) is not None:  # `pi4.yaml` from any folder
        path = profiles_dir() / text
    if not path.is_file():
        raise UserInputError("no such profile file; give a shipped name "
                             f"({', '.join(list_profiles())}) or a path to a YAML file", source=path)
    try:
        data = load_yaml(read_text_file(path), path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserInputError(yaml_error_detail(err), source=path) from None
    return DeviceProfile.from_dict(data, source=path)
