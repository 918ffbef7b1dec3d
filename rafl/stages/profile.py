"""``rafl profile``: the cost report of one subnet on a device (:func:`profile_subnet`), or a
measured per-layer latency LUT of a search space (:func:`build_lut`).

The search space comes from ``--supernet`` (a folder, ``quickstart`` or a shipped name such as
``cifar10``, as ``rafl search`` takes them), from the space an arch file records (``rafl
search``'s ``subnet.yaml``), or from ``--width-mult``/``--n-classes``. Errors name the command's
options (``--out``, ``--supernet``, ...). torch-heavy names are imported inside the functions, as
the command did, so ``rafl`` itself stays light to import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rafl.errors import UserInputError, load_error_detail
from rafl.folders import OnceKind

#: the files a report folder holds (a folder holding anything else is refused as ``--out``)
REPORT_FILES = ("cost_report.md", "cost_report.json", "cost_report.png")

#: ``rafl profile``'s report folder, written once (:class:`rafl.folders.OnceKind`): a new or empty
#: folder, or an earlier report (:data:`REPORT_FILES`), which is replaced
PROFILE_REPORT = OnceKind("`rafl profile`", owns=lambda p: p.name in REPORT_FILES)

#: the search space's defaults without --supernet or a recorded space (the command's option defaults)
DEFAULT_WIDTH_MULT = 1.0
DEFAULT_N_CLASSES = 10


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


def space_note(space) -> str:
    """``space`` in a few words: width, classes, resolutions."""
    return (f"width x{space.width_mult:g}, {space.n_classes} classes, "
            f"{'/'.join(str(r) for r in space.resolutions)} px")


def load_space(supernet_dir: str | Path | None, width_mult: float | None = None, n_classes: int | None = None):
    """``(space, supernet or None)``: the space (and weights) of ``supernet_dir`` -- a folder from
    ``rafl supernet train``, ``quickstart`` (the cached quickstart supernet) or a shipped name
    (``cifar10``) -- else the space of ``width_mult``/``n_classes`` (None: their defaults).

    Raises:
        UserInputError: (field ``--supernet``) an unknown folder, a broken or altered shipped
            supernet, or weights :func:`rafl.supernet.load_supernet` refuses.
    """
    from rafl.supernet.arch import SearchSpace

    if supernet_dir is not None:
        from rafl.supernet.pretrained import is_pretrained_name, pretrained_path
        from rafl.supernet.quickstart import supernet_path

        if is_pretrained_name(str(supernet_dir)):  # a shipped supernet (cifar10), checksum-checked
            try:
                supernet_dir = pretrained_path(str(supernet_dir))
            except UserInputError as err:
                raise UserInputError(err.message, source=err.source, field="--supernet") from None
        supernet_dir = supernet_path(supernet_dir, "--supernet")  # `quickstart`: the cached quickstart supernet
        if not supernet_dir.exists():
            raise UserInputError("no such supernet folder (from `rafl supernet train`)", source=supernet_dir,
                                 field="--supernet")
        from rafl.supernet import load_supernet

        supernet = load_supernet(supernet_dir).eval()
        return supernet.space, supernet
    return SearchSpace(width_mult=DEFAULT_WIDTH_MULT if width_mult is None else width_mult,
                       n_classes=DEFAULT_N_CLASSES if n_classes is None else n_classes), None


def load_arch(text: str, space, hint: str | None = None):
    """The arch of ``text`` (a file or an arch string), validated against ``space``; ``hint``
    is appended to the error of an arch outside the space.

    Raises:
        UserInputError: an unreadable or malformed arch, or one outside ``space``.
    """
    from rafl.supernet.arch import ArchConfig

    path = Path(text)
    try:
        if path.is_file() or path.suffix in (".yaml", ".yml", ".json"):
            return ArchConfig.load(path, space)
        return ArchConfig.from_string(text, space)
    except UserInputError as err:
        outside = (err.field or "").split("[")[0] in ("ks", "e", "d", "r")  # ArchConfig.validate's fields
        if hint is None or not outside:
            raise
        raise UserInputError(f"{err.message}; {hint}", source=err.source, field=err.field) from None


def recorded_space(text: str | None):
    """``(SearchSpace, supernet path or None, file)`` recorded with an arch file, or None.

    ``rafl search`` writes ``search_space`` and ``supernet`` into its ``subnet.yaml``; for a
    ``subnet.yaml`` written before it did, the ``result.json`` beside it (same arch) records them.

    Raises:
        UserInputError: a recorded ``search_space`` that is malformed.
    """

    import yaml

    from rafl.io import load_yaml, read_json_file, read_text_file
    from rafl.supernet.arch import SearchSpace

    if text is None:
        return None
    path = Path(text)
    if not path.is_file():
        return None
    try:
        data = load_yaml(read_text_file(path), path)
    except (yaml.YAMLError, UnicodeDecodeError, OSError, UserInputError):
        return None  # ArchConfig.load reports it
    if not isinstance(data, dict):
        return None
    source, rec = path, data
    if not isinstance(rec.get("search_space"), dict):
        beside = path.parent / "result.json"
        try:
            rec = read_json_file(beside) if beside.is_file() else None
        except (OSError, ValueError):
            rec = None
        if not (isinstance(rec, dict) and isinstance(rec.get("search_space"), dict)
                and rec.get("arch") == data.get("arch", data)):
            return None
        source = beside
    try:
        space = SearchSpace.from_dict(rec["search_space"], source=source)
    except (UserInputError, TypeError, ValueError) as err:
        raise UserInputError(f"search_space is malformed ({err})", source=source, field="search_space") from None
    supernet = rec.get("supernet")
    return space, (str(supernet) if supernet else None), source


def load_model(path: Path, arch_text: str | None, space, hint: str | None = None):
    """``(subnet, arch, space)`` from a subnet.safetensors (arch + space in its metadata) or a
    ``.pt`` state dict (needs ``arch_text``; loaded with ``weights_only=True``).

    Raises:
        UserInputError: (field ``--model``) a missing file, a ``.pt`` without ``arch_text``, one
            that does not unpickle or does not fit the arch; or what :func:`load_arch` and
            :func:`rafl.stages.search.load_searched_subnet` refuse.
    """
    if not path.exists():
        raise UserInputError("no such file", source=path, field="--model")
    if path.suffix in (".pt", ".pth"):
        import torch

        from rafl.supernet import subnet_from_arch

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
    from rafl.stages.search import load_searched_subnet

    sub = load_searched_subnet(path)
    return sub.eval(), sub.arch, sub.space


def is_latency_lut(path: Path) -> bool:
    """Whether ``path`` is a file that :func:`rafl.search.latency.load_latency_lut` reads."""
    from rafl.search.latency import load_latency_lut

    try:
        return path.is_file() and isinstance(load_latency_lut(path), dict)
    except UserInputError:
        return False


def check_lut_out(out: Path) -> None:
    """``out`` can take a latency LUT: a ``.yaml``/``.yml`` path that is new or an earlier LUT.

    Raises:
        UserInputError: (field ``--out``) another suffix, or an existing file that is not a LUT.
    """
    if out.suffix not in (".yaml", ".yml"):
        raise UserInputError("with --build-lut, --out is the LUT file and must end in .yaml/.yml",
                             source=out, field="--out")
    if out.exists() and not is_latency_lut(out):  # a rebuilt LUT replaces the old one, nothing else
        raise UserInputError("exists and is not a latency LUT (--build-lut replaces only an earlier LUT); "
                             "choose another --out", source=out, field="--out")


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
        UserInputError: ``out`` refused (:func:`check_lut_out`), or what :func:`load_space` refuses.
    """
    check_lut_out(out)
    if supernet_dir is None and width_mult is None and n_classes is None:
        from rafl.supernet.quickstart import quickstart_space

        space = quickstart_space()
        if say is not None:
            say(f"no --supernet: measuring the quickstart supernet's space ({space_note(space)}), the one "
                "rafl search and rafl federate use by default; pass --supernet DIR for another")
    else:
        space, _ = load_space(supernet_dir, width_mult, n_classes)
    from rafl.search.latency import build_latency_lut, latency_lut_correction
    from rafl.search.units import fixed_units, slot_units

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
    from rafl.io import load_yaml

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
    the one its arch file records (:func:`recorded_space`), else ``width_mult``/``n_classes``
    (None: not given, their defaults).

    Raises:
        UserInputError: neither ``arch_text`` nor ``model_path``, both with a safetensors model,
            ``out`` refused (:data:`PROFILE_REPORT`: a file, or a folder holding other files), a
            ``supernet_dir`` or ``width_mult``/``n_classes`` that contradict the space the arch
            file records, an arch outside the space, or what :func:`load_space`, :func:`load_arch`
            and :func:`load_model` refuse.
    """
    if arch_text is None and model_path is None:
        raise UserInputError("give --arch ARCH (file or string) or --model SUBNET", field="--arch/--model")
    if arch_text is not None and model_path is not None and model_path.suffix not in (".pt", ".pth"):
        raise UserInputError("a subnet.safetensors carries its own arch; drop --arch (only a .pt state dict "
                             "takes --arch)", field="--arch/--model")
    PROFILE_REPORT.check(out)
    space, supernet = load_space(supernet_dir, width_mult, n_classes)
    recorded = recorded_space(arch_text)
    hint = None
    if recorded is not None:
        rec_space, rec_supernet, rec_file = recorded
        origin = f"supernet {rec_supernet}" if rec_supernet else "its supernet"
        if supernet_dir is not None and supernet.space != rec_space:
            raise UserInputError(f"--supernet has another search space ({space_note(supernet.space)}) than "
                                 f"{rec_file} records for this arch ({space_note(rec_space)}, from {origin}); "
                                 "pass the supernet it was searched in, or drop --supernet",
                                 source=supernet_dir, field="--supernet")
        if supernet_dir is None:
            for name, opt, value in (("width_mult", "--width-mult", width_mult), ("n_classes", "--n-classes", n_classes)):
                if value is not None and value != getattr(rec_space, name):
                    raise UserInputError(f"is {value:g}, but {rec_file} records a search space with {name} "
                                         f"{getattr(rec_space, name):g} (from {origin}); drop {opt}", field=opt)
            space = rec_space  # the arch file's own space (as `rafl search` wrote it)
    elif supernet_dir is None:
        hint = (f"the arch is not in the search space used ({space_note(space)}: --width-mult/--n-classes or their defaults); "
                "pass --supernet DIR (the supernet it was searched in)")
    model = None
    if model_path is not None:
        model, arch, space = load_model(model_path, arch_text, space, hint)
        supernet = None
    else:
        arch = load_arch(arch_text, space, hint)
    # torch from here on: without --supernet or --model, a bad --arch was answered before it loads
    import torch

    from rafl.reports.profile_report import write_profile_report

    torch.set_num_threads(threads)
    with PROFILE_REPORT.write(out) as tmp:
        doc = write_profile_report(arch, prof, tmp, space=space, model=model, supernet=supernet,
                                   batch_size=batch_size, measure=measure, warmup=warmup, repeats=repeats)
    from rafl.search.cost import Cost

    cost = Cost(**{k: doc["cost"][k] if doc["cost"][k] is not None else float("nan") for k in Cost.__dataclass_fields__})
    return ProfileResult(arch=arch, space=space, profile=prof, doc=doc, cost=cost)


__all__ = ["DEFAULT_N_CLASSES", "DEFAULT_WIDTH_MULT", "REPORT_FILES", "LutResult", "ProfileResult", "build_lut",
           "check_lut_out", "PROFILE_REPORT", "is_latency_lut", "load_arch", "load_model", "load_space",
           "profile_subnet", "recorded_space", "space_note"]
