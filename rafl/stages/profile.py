"""``rafl profile``'s work: the cost report of one subnet on a device (:func:`profile_subnet`), or a
measured per-layer latency LUT of a search space (:func:`build_lut`).

The search space comes from ``--supernet`` (a folder, ``quickstart`` or a shipped name such as
``cifar10``, as ``rafl search`` takes them), from the space an arch file records (``rafl
search``'s ``subnet.yaml``), or from ``--width-mult``/``--n-classes``. The command checks what it
can before torch loads (:mod:`rafl.stages.profile_checks`: the report folder, the LUT's suffix,
and without ``--supernet`` the space and the arch) and imports this module after; its functions
call those checks again for a caller without the command. Errors name the command's options
(``--out``, ``--supernet``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rafl.errors import UserInputError, load_error_detail
from rafl.io import load_yaml
from rafl.reports.profile_report import write_profile_report
from rafl.search.cost import Cost
from rafl.search.latency import build_latency_lut, latency_lut_correction
from rafl.search.units import fixed_units, slot_units
from rafl.stages.profile_checks import (
    PROFILE_REPORT,
    arch_space,
    check_lut_out,
    check_model_path,
    check_report,
    default_space,
    load_arch,
    space_note,
)
from rafl.stages.search import load_searched_subnet
from rafl.supernet import load_supernet, subnet_from_arch
from rafl.supernet.pretrained import is_pretrained_name, pretrained_path
from rafl.supernet.quickstart import quickstart_space, supernet_path


@dataclass
class LutResult:
    """What :func:`build_lut` wrote: ``entries`` layer configurations in ``path``, the whole-network
    correction ``(a, b)`` and ``warning``, the correction's fit method when its two-term fit was
    rejected (else None)."""

    path: Path
    entries: int
    correction: tuple[float, float]
    warning: str | None


@dataclass
class ProfileResult:
    """What :func:`profile_subnet` wrote: the report document (``cost_report.json``'s content) of
    ``arch`` in ``space`` on ``profile``, and its cost (NaN for a figure the report lacks)."""

    arch: Any
    space: Any
    profile: Any
    doc: dict[str, Any]
    cost: Any


def load_space(supernet_dir: str | Path | None, width_mult: float | None = None, n_classes: int | None = None):
    """``(space, supernet or None)``: the space (and weights) of ``supernet_dir`` -- a folder from
    ``rafl supernet train``, ``quickstart`` (the cached quickstart supernet) or a shipped name
    (``cifar10``) -- else the space of ``width_mult``/``n_classes`` (None: their defaults).

    Raises:
        UserInputError: (field ``--supernet``) an unknown folder, a broken or altered shipped
            supernet, or weights :func:`rafl.supernet.load_supernet` refuses.
    """
    if supernet_dir is not None:
        if is_pretrained_name(str(supernet_dir)):  # a shipped supernet (cifar10), checksum-checked
            try:
                supernet_dir = pretrained_path(str(supernet_dir))
            except UserInputError as err:
                raise UserInputError(err.message, source=err.source, field="--supernet") from None
        supernet_dir = supernet_path(supernet_dir, "--supernet")  # `quickstart`: the cached quickstart supernet
        if not supernet_dir.exists():
            raise UserInputError("no such supernet folder (from `rafl supernet train`)", source=supernet_dir,
                                 field="--supernet")
        supernet = load_supernet(supernet_dir).eval()
        return supernet.space, supernet
    return default_space(width_mult, n_classes), None


def load_model(path: Path, arch_text: str | None, space, hint: str | None = None):
    """``(subnet, arch, space)`` from a subnet.safetensors (arch + space in its metadata) or a
    ``.pt`` state dict (needs ``arch_text``; loaded with ``weights_only=True``).

    Raises:
        UserInputError: (field ``--model``) a missing file, a ``.pt`` without ``arch_text``, one
            that does not unpickle or does not fit the arch; or what
            :func:`~rafl.stages.profile_checks.load_arch` and
            :func:`rafl.stages.search.load_searched_subnet` refuse.
    """
    check_model_path(path)
    if path.suffix in (".pt", ".pth"):
        if arch_text is None:
            raise UserInputError("a .pt state dict needs --arch (the subnet's arch file or string)", source=path,
                                 field="--model")
        arch = load_arch(arch_text, space, hint)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unpickling/format problem is bad input
            raise UserInputError(f"not a loadable state dict ({err.__class__.__name__})", source=path,
                                 field="--model") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        sub = subnet_from_arch(space, arch)
        try:
            sub.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as err:
            raise UserInputError(f"state dict does not fit arch {arch.to_string(space)} at width "
                                 f"x{space.width_mult}: {load_error_detail(err)}", source=path,
                                 field="--model") from None
        return sub.eval(), arch, space
    sub = load_searched_subnet(path)
    return sub.eval(), sub.arch, sub.space


def build_lut(prof, out: Path, *, supernet_dir: str | Path | None = None, width_mult: float | None = None,
              n_classes: int | None = None, threads: int = 1, warmup: int = 5, repeats: int = 20,
              clock: str = "wall", statistic: str = "median", calibrate: int = 20, progress: bool = True,
              say: Callable[[str], None] | None = None) -> LutResult:
    """Measure every distinct layer of a search space on this machine into the LUT file ``out``
    (YAML; :func:`rafl.search.latency.build_latency_lut`), for device profile ``prof`` (its name
    is recorded).

    The space is :func:`load_space`'s; with neither ``supernet_dir`` nor ``width_mult``/``n_classes``
    (None: not given), the quickstart supernet's space (the one ``rafl search`` and ``rafl
    federate`` use by default), which ``say`` notes.

    Raises:
        UserInputError: ``out`` refused (:func:`rafl.stages.profile_checks.check_lut_out`), or what :func:`load_space` refuses.
    """
    check_lut_out(out)
    if supernet_dir is None and width_mult is None and n_classes is None:
        space = quickstart_space()
        if say is not None:
            say(f"no --supernet: measuring the quickstart supernet's space ({space_note(space)}), the one "
                "rafl search and rafl federate use by default; pass --supernet DIR for another")
    else:
        space, _ = load_space(supernet_dir, width_mult, n_classes)
    specs = []
    for r in space.resolutions:
        head, tail = fixed_units(space, r)
        specs += [s for _, s in head + tail]
        specs += [s for row in slot_units(space, r) for col in row for s in col]
    entries = build_latency_lut(specs, out, threads=threads, warmup=warmup, repeats=repeats,
                                progress=progress, clock=clock, statistic=statistic, space=space,
                                calibrate=calibrate,
                                meta={"device_profile": prof.name, "search_space": space.to_dict()})
    a, b = latency_lut_correction(out)
    method = (load_yaml(out.read_text(), out).get("network_correction") or {}).get("method", "")
    return LutResult(path=out, entries=len(entries), correction=(a, b),
                     warning=method if "two-term fit gave" in method else None)


def profile_subnet(prof, out: Path, *, arch_text: str | None = None, model_path: Path | None = None,
                   supernet_dir: str | Path | None = None, width_mult: float | None = None,
                   n_classes: int | None = None, batch_size: int | None = None, threads: int = 1, warmup: int = 5,
                   repeats: int = 20, measure: bool = True) -> ProfileResult:
    """The cost report of a subnet on device profile ``prof``, written atomically into the folder
    ``out`` (:data:`REPORT_FILES`; :func:`rafl.reports.profile_report.write_profile_report`).

    The subnet is ``arch_text`` (an arch file or string) or ``model_path`` (a subnet.safetensors,
    or a ``.pt`` state dict together with ``arch_text``). Its space is ``supernet_dir``'s, else
    the one its arch file records (:func:`~rafl.stages.profile_checks.recorded_space`), else
    ``width_mult``/``n_classes`` (None: not given, their defaults).

    Raises:
        UserInputError: neither ``arch_text`` nor ``model_path``, both with a safetensors model,
            ``out`` refused (:data:`PROFILE_REPORT`: a file, or a folder holding other files), a
            ``supernet_dir`` or ``width_mult``/``n_classes`` that contradict the space the arch
            file records, an arch outside the space, or what :func:`load_space`, :func:`load_arch`
            and :func:`load_model` refuse (:func:`~rafl.stages.profile_checks.check_report`: the
            checks before torch).
    """
    # every check before torch (the command made them before it loaded this module)
    check_report(out, arch_text=arch_text, model_path=model_path, supernet_dir=supernet_dir, width_mult=width_mult,
                 n_classes=n_classes)
    space, supernet = load_space(supernet_dir, width_mult, n_classes)
    space, hint = arch_space(space, arch_text, supernet_dir=supernet_dir, width_mult=width_mult, n_classes=n_classes)
    model = None
    if model_path is not None:
        model, arch, space = load_model(model_path, arch_text, space, hint)
        supernet = None
    else:
        arch = load_arch(arch_text, space, hint)
    torch.set_num_threads(threads)
    with PROFILE_REPORT.write(out) as tmp:
        doc = write_profile_report(arch, prof, tmp, space=space, model=model, supernet=supernet,
                                   batch_size=batch_size, measure=measure, warmup=warmup, repeats=repeats)
    cost = Cost(**{k: doc["cost"][k] if doc["cost"][k] is not None else float("nan") for k in Cost.__dataclass_fields__})
    return ProfileResult(arch=arch, space=space, profile=prof, doc=doc, cost=cost)


__all__ = ["LutResult", "ProfileResult", "build_lut", "load_model", "load_space",
           "profile_subnet"]
