"""``rafl profile``: the cost report of one subnet on a device, or a measured latency LUT."""

from __future__ import annotations

from pathlib import Path

import click

from rafl.cli._types import FiniteFloatRange
from rafl.errors import UserInputError
from rafl.supernet.arch import N_CLASSES_MAX, N_CLASSES_MIN, WIDTH_MULT_MAX, WIDTH_MULT_MIN


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
              help="Supernet folder, `quickstart` (the cached quickstart supernet) or a shipped one by name: "
                   "cifar10 or cifar10-proxy5k. Its search space (and "
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
              help="Timed repeats at batch 1 (median and p90 reported; the LUT keeps the --statistic); the "
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
    from rafl.search.profile import load_profile
    from rafl.stages.profile_checks import check_lut_out, check_report

    # every check below runs before torch loads (a typo answers at once); the work module after them
    prof = load_profile(device_profile)  # bad profile: exit 2 before any work
    ctx = click.get_current_context()
    given = {name: value for name, value in (("width_mult", width_mult), ("n_classes", n_classes))
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    if build_lut:
        if arch_text or model_path:
            raise UserInputError("--build-lut measures every layer of the space; drop --arch/--model",
                                 field="--build-lut")
        check_lut_out(out)
        from rafl.stages import profile as stage

        res = stage.build_lut(prof, out, supernet_dir=supernet_dir, threads=threads, warmup=warmup, repeats=repeats,
                              clock=clock, statistic=statistic, calibrate=calibrate, progress=not quiet,
                              say=lambda line: click.echo(line, err=True), **given)
        a, b = res.correction
        corr = (f"; whole-network correction a = {a:.3f}, b = {b:+.3f} ms from {calibrate} random subnets"
                if calibrate else "")
        click.echo(f"wrote {out}: {res.entries} layer configurations, {statistic} of {repeats} runs each "
                   f"({threads} thread(s), {clock} clock){corr}; reference it from a profile with "
                   f"`latency_lut: {out}`")
        if res.warning:
            click.echo(f"warning: network_correction: {res.warning}", err=True)
        return

    check_report(out, arch_text=arch_text, model_path=model_path, supernet_dir=supernet_dir, **given)
    from rafl.stages import profile as stage

    res = stage.profile_subnet(prof, out, arch_text=arch_text, model_path=model_path, supernet_dir=supernet_dir,
                               batch_size=batch_size, threads=threads, warmup=warmup, repeats=repeats,
                               measure=not no_measure, **given)
    from rafl.reports.profile_report import fmt_cost

    doc = res.doc
    verdict = "feasible" if doc["feasible"] else "INFEASIBLE: " + "; ".join(
        f"{b['budget']} {b['value']:.4g} > {b['limit']:.4g}" for b in doc["budgets"] if not b["passed"])
    click.echo(f"{res.arch.to_string(res.space)} on {prof.name}: {fmt_cost(res.cost)} -> {verdict}")
    click.echo(f"wrote {out}/cost_report.md, .json, .png")
