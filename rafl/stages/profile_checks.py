"""``rafl profile``'s checks: what the command answers before torch loads.

A report's request (:func:`check_report`: an arch or a model, the report folder, and -- without
``--supernet`` -- the search space, the arch in it and a model file that is there), a LUT's
output path (:func:`check_lut_out`), and the pieces the work module (:mod:`rafl.stages.profile`)
calls again with a supernet's space: the space an arch file records (:func:`recorded_space`,
:func:`arch_space`) and the arch itself (:func:`load_arch`). A supernet's space comes with its
weights, so with ``--supernet`` the rest is checked once torch has loaded.

This module imports no torch, directly or through what it imports (``lint-imports``' contract
"check modules import no torch"). Errors name the command's options (``--out``, ``--arch``, ...).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rafl.errors import UserInputError
from rafl.folders import OnceKind, check_creatable
from rafl.io import load_yaml, read_json_file, read_text_file
from rafl.search.profile import LUT_FORMAT
from rafl.supernet.arch import ArchConfig, SearchSpace

#: the files a report folder holds (a folder holding anything else is refused as ``--out``)
REPORT_FILES = ("cost_report.md", "cost_report.json", "cost_report.png")

#: ``rafl profile``'s report folder, written once (:class:`rafl.folders.OnceKind`): a new or empty
#: folder, or an earlier report (:data:`REPORT_FILES`), which is replaced
PROFILE_REPORT = OnceKind("`rafl profile`", owns=lambda p: p.name in REPORT_FILES)

#: the search space's defaults without --supernet or a recorded space (the command's option defaults)
DEFAULT_WIDTH_MULT = 1.0
DEFAULT_N_CLASSES = 10


def space_note(space) -> str:
    """``space`` in a few words: width, classes, resolutions."""
    return (f"width x{space.width_mult:g}, {space.n_classes} classes, "
            f"{'/'.join(str(r) for r in space.resolutions)} px")


def default_space(width_mult: float | None = None, n_classes: int | None = None) -> SearchSpace:
    """The space of ``width_mult``/``n_classes`` (None: their defaults), without ``--supernet``."""
    return SearchSpace(width_mult=DEFAULT_WIDTH_MULT if width_mult is None else width_mult,
                       n_classes=DEFAULT_N_CLASSES if n_classes is None else n_classes)


def load_arch(text: str, space, hint: str | None = None):
    """The arch of ``text`` (a file or an arch string), validated against ``space``; ``hint``
    is appended to the error of an arch outside the space.

    Raises:
        UserInputError: an unreadable or malformed arch, or one outside ``space``.
    """
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


def arch_space(space, arch_text: str | None, *, supernet_dir: str | Path | None = None,
               width_mult: float | None = None, n_classes: int | None = None) -> tuple[SearchSpace, str | None]:
    """``(space, hint)``: the space an arch is read in and the hint for an arch outside it.

    ``space`` is ``supernet_dir``'s, or without it :func:`default_space`'s; an arch file that
    records its space (:func:`recorded_space`) is read in that one, which ``supernet_dir`` or
    ``width_mult``/``n_classes`` (None: not given) must not contradict.

    Raises:
        UserInputError: a recorded space that is malformed or that ``supernet_dir``, ``width_mult``
            or ``n_classes`` contradict.
    """
    recorded = recorded_space(arch_text)
    hint = None
    if recorded is not None:
        rec_space, rec_supernet, rec_file = recorded
        origin = f"supernet {rec_supernet}" if rec_supernet else "its supernet"
        if supernet_dir is not None and space != rec_space:
            raise UserInputError(f"--supernet has another search space ({space_note(space)}) than "
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
    return space, hint


def check_model_path(path: Path) -> None:
    """``--model`` is there.

    Raises:
        UserInputError: (field ``--model``) no such file."""
    if not path.exists():
        raise UserInputError("no such file", source=path, field="--model")


def check_report(out: Path, *, arch_text: str | None = None, model_path: Path | None = None,
                 supernet_dir: str | Path | None = None, width_mult: float | None = None,
                 n_classes: int | None = None) -> None:
    """The checks of :func:`rafl.stages.profile.profile_subnet` that need no torch, in its order:
    an arch or a model (not both with a safetensors model), the report folder ``out``, and, without
    ``supernet_dir``, the space (:func:`arch_space`), the arch in it (:func:`load_arch`) or the model
    file (:func:`check_model_path`). With ``supernet_dir`` the space comes with the supernet's
    weights, and ``profile_subnet`` checks the rest once torch has loaded.

    Raises:
        UserInputError: neither ``arch_text`` nor ``model_path``, both with a safetensors model,
            ``out`` refused (:data:`PROFILE_REPORT`: a file, or a folder holding other files), or
            what :func:`arch_space`, :func:`load_arch` and :func:`check_model_path` refuse.
    """
    if arch_text is None and model_path is None:
        raise UserInputError("give --arch ARCH (file or string) or --model SUBNET", field="--arch/--model")
    if arch_text is not None and model_path is not None and model_path.suffix not in (".pt", ".pth"):
        raise UserInputError("a subnet.safetensors carries its own arch; drop --arch (only a .pt state dict "
                             "takes --arch)", field="--arch/--model")
    PROFILE_REPORT.check(out)
    if supernet_dir is not None:
        return
    space, hint = arch_space(default_space(width_mult, n_classes), arch_text, width_mult=width_mult,
                             n_classes=n_classes)
    if model_path is None:
        load_arch(arch_text, space, hint)
    else:
        check_model_path(model_path)


def check_lut_out(out: Path) -> None:
    """``out`` can take a latency LUT: a ``.yaml``/``.yml`` path that is new or an earlier LUT (a YAML
    mapping tagged ``format: rafl-latency-lut/1``, :data:`rafl.search.profile.LUT_FORMAT`), in a folder
    that exists or can be made; a rebuilt LUT replaces only an earlier one.

    Raises:
        UserInputError: (field ``--out``) another suffix, a folder, an existing file that is not a LUT,
            or a parent that is a file or does not accept new files.
    """
    if out.suffix.lower() not in (".yaml", ".yml"):
        raise UserInputError("with --build-lut, --out is the LUT file and must end in .yaml/.yml",
                             source=out, field="--out")
    if out.is_dir():
        raise UserInputError("is a folder; with --build-lut, --out is the LUT file (a .yaml/.yml path)",
                             source=out, field="--out")
    check_creatable(out.parent, "--out")
    if not out.exists():
        return
    try:
        data = load_yaml(read_text_file(out), out)
    except (UserInputError, yaml.YAMLError, UnicodeDecodeError):  # unreadable, not YAML, not text: not a LUT
        data = None
    if not isinstance(data, dict) or data.get("format") != LUT_FORMAT:
        raise UserInputError("exists and is not a latency LUT (--build-lut replaces only an earlier LUT); "
                             "choose another --out", source=out, field="--out")


__all__ = ["DEFAULT_N_CLASSES", "DEFAULT_WIDTH_MULT", "PROFILE_REPORT", "REPORT_FILES", "arch_space",
           "check_lut_out", "check_model_path", "check_report", "default_space", "load_arch", "recorded_space",
           "space_note"]
