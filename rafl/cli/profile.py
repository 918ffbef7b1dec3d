"""``rafl profile``: the cost report of one subnet on a device, or a measured latency LUT."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.cli._types import FiniteFloatRange
from rafl.errors import UserInputError, load_error_detail
from rafl.supernet.arch import N_CLASSES_MAX, N_CLASSES_MIN, WIDTH_MULT_MAX, WIDTH_MULT_MIN

REPORT_FILES = ("cost_report.md", "cost_report.json", "cost_report.png")


def _space(width_mult: float, n_classes: int, supernet_dir: Path | None):
    """``(space, supernet or None)`` from --supernet or --width-mult/--n-classes."""
    from rafl.supernet.arch import SearchSpace

    if supernet_dir is not None:
        from rafl.supernet.quickstart import supernet_path

        supernet_dir = supernet_path(supernet_dir, "--supernet")  # `quickstart`: the cached quickstart supernet
        if not supernet_dir.exists():
            raise UserInputError("no such supernet folder (from `rafl supernet train`)", source=supernet_dir,
                                 field="--supernet")
        from rafl.supernet import load_supernet

        supernet = load_supernet(supernet_dir).eval()
        return supernet.space, supernet
    return SearchSpace(width_mult=width_mult, n_classes=n_classes), None


def _load_arch(text: str, space, hint: str | None = None):
    """The arch of ``text`` (a file or an arch string), validated against ``space``; ``hint``
    is appended to the error of an arch outside the space."""
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


def _recorded_space(text: str | None):
    """``(SearchSpace, supernet path or None, file)`` recorded with an arch file, or None.

    ``rafl search`` writes ``search_space`` and ``supernet`` into its ``subnet.yaml``; for a
    ``subnet.yaml`` written before it did, the ``result.json`` beside it (same arch) records them.
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


def _space_note(space) -> str:
    return (f"width x{space.width_mult:g}, {space.n_classes} classes, "
            f"{'/'.join(str(r) for r in space.resolutions)} px")


def _load_model(path: Path, arch_text: str | None, space, hint: str | None = None):
    """``(subnet, arch, space)`` from a subnet.safetensors (arch + space in its metadata) or a
    ``.pt`` state dict (needs --arch; loaded with ``weights_only=True``)."""
    if not path.exists():
        raise UserInputError("no such file", source=path, field="--model")
    if path.suffix in (".pt", ".pth"):
        import torch

        from rafl.supernet import subnet_from_arch

        if arch_text is None:
            raise UserInputError("a .pt state dict needs --arch (the subnet's arch file or string)", source=path,
                                 field="--model")
        arch = _load_arch(arch_text, space, hint)
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



def _is_latency_lut(path: Path) -> bool:
    """Whether ``path`` is a file that :func:`rafl.search.latency.load_latency_lut` reads."""
    from rafl.search.latency import load_latency_lut

    try:
        return path.is_file() and isinstance(load_latency_lut(path), dict)
    except UserInputError:
        return False


@click.command("profile")
@click.option("--device-profile", "device_profile", required=True,
              help="Shipped profile name (pi4, jetson-nano, phone, mcu, server-gpu; or its file name pi4.yaml, from any folder) or a YAML path.")
@click.option("--arch", "arch_text", default=None,
              help="Subnet arch: a YAML/JSON file (ks, e, d, r) or an arch string like 'r32_k3e4.k5e6|...'. "
                   "A subnet.yaml from `rafl search` records its search space, which is used without --supernet.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="Subnet weights: subnet.safetensors from `rafl search` (arch and space inside), or a "
                   ".pt state dict together with --arch.")
@click.option("--supernet", "supernet_dir", type=click.Path(path_type=Path), default=None,
              help="Supernet folder (or `quickstart`, the cached quickstart supernet): its search space (and "
                   "weights) are used. --build-lut without it (and without --width-mult/--n-classes) measures "
                   "the quickstart supernet's space.")
@click.option("--width-mult", type=FiniteFloatRange(min=WIDTH_MULT_MIN, max=WIDTH_MULT_MAX), default=1.0,
              show_default=True,
              help=f"Search-space width multiplier, {WIDTH_MULT_MIN:g}..{WIDTH_MULT_MAX:g} (without --supernet "
                   "or a recorded space).")
@click.option("--n-classes", type=click.IntRange(min=N_CLASSES_MIN, max=N_CLASSES_MAX), default=10,
              show_default=True,
              help=f"Classes of the classifier, {N_CLASSES_MIN}..{N_CLASSES_MAX} (without --supernet or a "
                   "recorded space).")
@click.option("--build-lut", is_flag=True,
              help="Measure the latency of every distinct layer of the space on THIS machine and write a "
                   "LUT (YAML) that a profile can reference with `latency_lut: PATH`.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Report folder (cost_report.md/.json/.png), or the LUT file with --build-lut.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Batch B of training memory and of the host measurement [default: the profile's].")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads while measuring latency.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Untimed warm-up runs.")
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed repeats at batch 1 (median and p90 reported; the LUT keeps the median); the "
                   "training-batch measurement uses half as many (at least 3) and half the warm-up.")
@click.option("--clock", type=click.Choice(["wall", "thread"]), default="wall", show_default=True,
              help="LUT timing clock: wall clock (a quiet device), or the thread's CPU time (a shared, "
                   "loaded host; use with --threads 1).")
@click.option("--statistic", type=click.Choice(["median", "min"]), default="median", show_default=True,
              help="--build-lut: the LUT keeps the median of the timed runs (a quiet device) or the minimum "
                   "(the run least disturbed by other processes: a shared host).")
@click.option("--calibrate", type=click.IntRange(min=0), default=20, show_default=True,
              help="--build-lut: also time this many random whole subnets and store the LUT's "
                   "network_correction (whole latency = a x sum of layers + b); 0 = none.")
@click.option("--no-measure", is_flag=True, help="Skip the host latency measurement in the report.")
@click.option("--quiet", "--no-progress", "quiet", is_flag=True, help="No progress bar.")
def profile(device_profile: str, arch_text: str | None, model_path: Path | None, supernet_dir: Path | None,
            width_mult: float, n_classes: int, build_lut: bool, out: Path, batch_size: int | None, threads: int,
            warmup: int, repeats: int, clock: str, statistic: str, calibrate: int, no_measure: bool,
            quiet: bool) -> None:
    """Cost report of a subnet on a device, or (--build-lut) a measured per-layer latency table.

    \b
    rafl profile --arch runs/search/pi4/subnet.yaml --device-profile pi4 --out report/
    rafl profile --model runs/search/pi4/subnet.safetensors --device-profile pi4 --out report/
    rafl profile --build-lut --device-profile pi4 --out pi4-lut.yaml
    """
    import torch

    from rafl.search.profile import load_profile

    prof = load_profile(device_profile)  # bad profile: exit 2 before any work
    if build_lut:
        if arch_text or model_path:
            raise UserInputError("--build-lut measures every layer of the space; drop --arch/--model",
                                 field="--build-lut")
        if out.suffix not in (".yaml", ".yml"):
            raise UserInputError("with --build-lut, --out is the LUT file and must end in .yaml/.yml",
                                 source=out, field="--out")
        if out.exists() and not _is_latency_lut(out):  # a rebuilt LUT replaces the old one, nothing else
            raise UserInputError("exists and is not a latency LUT (--build-lut replaces only an earlier LUT); "
                                 "choose another --out", source=out, field="--out")
        ctx = click.get_current_context()
        given = [opt for name, opt in (("width_mult", "--width-mult"), ("n_classes", "--n-classes"))
                 if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
        if supernet_dir is None and not given:  # the space `rafl search` / `rafl federate` use without --supernet
            from rafl.supernet.quickstart import quickstart_space

            space = quickstart_space()
            click.echo(f"no --supernet: measuring the quickstart supernet's space ({_space_note(space)}), the one "
                       "rafl search and rafl federate use by default; pass --supernet DIR for another", err=True)
        else:
            space, _ = _space(width_mult, n_classes, supernet_dir)
        from rafl.search.latency import build_latency_lut
        from rafl.search.units import fixed_units, slot_units

        specs = []
        for r in space.resolutions:
            head, tail = fixed_units(space, r)
            specs += [s for _, s in head + tail]
            specs += [s for row in slot_units(space, r) for col in row for s in col]
        entries = build_latency_lut(specs, out, threads=threads, warmup=warmup, repeats=repeats,
                                    progress=not quiet, clock=clock, statistic=statistic, space=space,
                                    calibrate=calibrate,
                                    meta={"device_profile": prof.name, "search_space": space.to_dict()})
        from rafl.search.latency import latency_lut_correction

        a, b = latency_lut_correction(out)
        corr = (f"; whole-network correction a = {a:.3f}, b = {b:+.3f} ms from {calibrate} random subnets"
                if calibrate else "")
        click.echo(f"wrote {out}: {len(entries)} layer configurations, {statistic} of {repeats} runs each "
                   f"({threads} thread(s), {clock} clock){corr}; reference it from a profile with "
                   f"`latency_lut: {out}`")
        from rafl.io import load_yaml

        method = (load_yaml(out.read_text(), out).get("network_correction") or {}).get("method", "")
        if "two-term fit gave" in method:
            click.echo(f"warning: network_correction: {method}", err=True)
        return

    if arch_text is None and model_path is None:
        raise UserInputError("give --arch ARCH (file or string) or --model SUBNET", field="--arch/--model")
    if arch_text is not None and model_path is not None and model_path.suffix not in (".pt", ".pth"):
        raise UserInputError("a subnet.safetensors carries its own arch; drop --arch (only a .pt state dict "
                             "takes --arch)", field="--arch/--model")
    if out.exists() and not out.is_dir():
        raise UserInputError("exists and is not a folder", source=out, field="--out")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if p.name not in REPORT_FILES]
        if foreign:
            raise UserInputError(f"folder holds other files ({', '.join(sorted(foreign)[:3])}); choose a new "
                                 "or empty folder", source=out, field="--out")
    space, supernet = _space(width_mult, n_classes, supernet_dir)
    recorded = _recorded_space(arch_text)
    hint = None
    if recorded is not None:
        rec_space, rec_supernet, rec_file = recorded
        origin = f"supernet {rec_supernet}" if rec_supernet else "its supernet"
        if supernet_dir is not None and supernet.space != rec_space:
            raise UserInputError(f"--supernet has another search space ({_space_note(supernet.space)}) than "
                                 f"{rec_file} records for this arch ({_space_note(rec_space)}, from {origin}); "
                                 "pass the supernet it was searched in, or drop --supernet",
                                 source=supernet_dir, field="--supernet")
        if supernet_dir is None:
            ctx = click.get_current_context()
            for name, opt, value in (("width_mult", "--width-mult", width_mult), ("n_classes", "--n-classes", n_classes)):
                if (ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
                        and value != getattr(rec_space, name)):
                    raise UserInputError(f"is {value:g}, but {rec_file} records a search space with {name} "
                                         f"{getattr(rec_space, name):g} (from {origin}); drop {opt}", field=opt)
            space = rec_space  # the arch file's own space (as `rafl search` wrote it)
    elif supernet_dir is None:
        hint = (f"the arch is not in the search space used ({_space_note(space)}: --width-mult/--n-classes or their defaults); "
                "pass --supernet DIR (the supernet it was searched in)")
    model = None
    if model_path is not None:
        model, arch, space = _load_model(model_path, arch_text, space, hint)
        supernet = None
    else:
        arch = _load_arch(arch_text, space, hint)
    from rafl.io import atomic_dir
    from rafl.reports.profile_report import fmt_cost, write_profile_report

    torch.set_num_threads(threads)
    with atomic_dir(out, overwrite=True) as tmp:
        doc = write_profile_report(arch, prof, tmp, space=space, model=model, supernet=supernet,
                                   batch_size=batch_size, measure=not no_measure, warmup=warmup, repeats=repeats)
    from rafl.search.cost import Cost

    cost = Cost(**{k: doc["cost"][k] if doc["cost"][k] is not None else float("nan") for k in Cost.__dataclass_fields__})
    verdict = "feasible" if doc["feasible"] else "INFEASIBLE: " + "; ".join(
        f"{b['budget']} {b['value']:.4g} > {b['limit']:.4g}" for b in doc["budgets"] if not b["passed"])
    click.echo(f"{arch.to_string(space)} on {prof.name}: {fmt_cost(cost)} -> {verdict}")
    click.echo(f"wrote {out}/cost_report.md, .json, .png")
