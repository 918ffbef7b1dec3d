"""``rafl search`` as a library call: load everything, search, write one folder per profile.

Output per profile, in ``<out>/<profile>/`` (each folder is built under a temp name and renamed
when complete, so an interrupted run leaves nothing half-written):

- ``subnet.yaml``: the chosen :class:`ArchConfig` (``arch``, ``string``), with the
  ``search_space`` it belongs to and the ``supernet`` folder it was searched in (so
  ``rafl profile --arch subnet.yaml`` needs no ``--supernet``);
- ``subnet.safetensors``: its weights, BN recalibrated on the server's pool-train data, with the
  arch and search space in the safetensors metadata (load with :func:`load_searched_subnet`);
- ``subnet.onnx``: an ONNX export for deployment, checked by ``onnx.checker`` and by running it
  in onnxruntime against the PyTorch output;
- the profiling report of the cost model (``cost.json`` + ``cost_report.*`` when available);
- ``history.jsonl``: one line per generation (best feasible accuracy so far, best arch, ...);
- ``pareto.json`` / ``pareto.png``: accuracy vs latency and vs MACs of every evaluated arch;
- ``result.json``: the summary (arch, measured and predicted accuracy, cost, budgets, predictor
  Kendall tau, the re-measured top-k, ``found_for``: the profile whose evolution found the arch,
  ``shared_candidates``: the other profiles' finalists considered, the resolved search config and
  the supernet used).

And ``<out>/pareto.png``: every profile of the run's pick (measured and predicted accuracy) against
its predicted device latency, each profile's latency budget a line
(:func:`rafl.search.pareto.save_picks_plot`); ``<out>/search.json``: one entry per profile folder present in ``<out>`` (a later search into
the same folder adds or replaces its own profiles' folders and keeps the others, so the index is
rebuilt from every ``<out>/<profile>/result.json`` after each folder is written, atomically), with
the supernet, data and config of the latest run.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors

from rafl import seeds
from rafl.data import load_dataset
from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes, atomic_write_json, atomic_write_text, safetensors_damage
from rafl.reports.profile_report import write_profile_report
from rafl.search.cost import CostModel
from rafl.search.estimators import MeasuredAccuracy, measurement_cache_dir, sample_across_space, supernet_fingerprint
from rafl.search.evolution import BINDING_USE, SearchConfig, SearchResult, binding_text, search_subnets
from rafl.search.genome import Population
from rafl.search.pareto import save_fronts, save_picks_plot
from rafl.search.predictor import kendall_tau, tau_meaning, train_predictor
from rafl.search.profile import load_profile
from rafl.stages.checks import SEARCH_OUTPUT
from rafl.supernet import extract_subnet, load_supernet, quickstart_supernet, recalibrate_bn, subnet_from_arch
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.supernet.calibration import load_calibration, save_calibration
from rafl.supernet.checkpoint import load_meta
from rafl.supernet.model import prepare_input
from rafl.supernet.pretrained import (
    CALIBRATION_NAME,
    MEASUREMENTS_NAME,
    measured_alike,
    resolve_supernet,
    supernet_measurements,
)
from rafl.supernet.server_data import calibration_sample, server_split
from rafl.threads import torch_threads

SUBNET_WEIGHTS = "subnet.safetensors"


# ---------------------------------------------------------------------- server data
def server_dataset(meta_config: dict[str, Any] | None, space: SearchSpace, progress: bool = True,
                   data_root: str | Path | None = None):
    """``(dataset, split, info)``: the supernet's dataset and its server split, rebuilt from the
    dataset settings saved in its training config (see :func:`server_eval_data`); ``data_root``:
    where the dataset is (``--data-root``), instead of the root the training config recorded.

    Raises:
        UserInputError: an empty validation split, or a dataset whose classes do not match the
            supernet's ``n_classes``.
    """
    cfg = dict(meta_config or {})
    data_cfg = cfg.get("data", cfg) if isinstance(cfg.get("data"), dict) else cfg
    name = data_cfg.get("dataset", "digits")
    root = data_root if data_root is not None else data_cfg.get("data_root", data_cfg.get("root"))
    resolution = int(data_cfg.get("image_size", data_cfg.get("resolution", max(space.resolutions))))
    limit = data_cfg.get("limit_per_class")
    public_fraction = float(data_cfg.get("public_fraction", 0.3))
    public_seed = int(data_cfg.get("public_seed", 0))
    val_fraction = float(data_cfg.get("val_fraction", 0.1))
    ds = load_dataset(name, root=root, resolution=resolution, limit_per_class=limit, progress=progress)
    if ds.num_classes != space.n_classes:
        raise UserInputError(f"dataset {name!r} has {ds.num_classes} classes, the supernet "
                             f"{space.n_classes}", field="supernet.config.dataset")
    split = server_split(ds, public_fraction=public_fraction, public_seed=public_seed,
                         val_fraction=val_fraction)
    if len(split.pool_val) == 0:
        raise UserInputError(f"the server's validation split is empty (public_fraction="
                             f"{public_fraction}, val_fraction={val_fraction}); the search needs "
                             "labelled server data", field="val_fraction")
    info = {"dataset": name, "public_fraction": public_fraction, "public_seed": public_seed,
            "val_fraction": val_fraction, "n_val": int(len(split.pool_val)),
            "n_calib": int(len(split.pool_train))}
    return ds, split, info


def server_eval_data(meta_config: dict[str, Any] | None, space: SearchSpace, progress: bool = True,
                     data_root: str | Path | None = None
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, dict[str, Any]]:
    """The server's validation split and BN-calibration images for the search.

    Rebuilds the supernet's own server split (:func:`rafl.supernet.server_data.server_split`)
    from the dataset settings saved in its training config (``dataset``, ``data_root``,
    ``image_size``, ``limit_per_class``, ``public_fraction``, ``public_seed``, ``val_fraction`` of
    :class:`rafl.supernet.train.TrainConfig`): accuracy is measured on server-val,
    BN statistics are re-estimated on pool-train; no client data is touched. ``progress``: show
    the bars of reading a dataset source (a cache miss). ``data_root``: where the dataset is
    (``--data-root``), instead of the root the training config recorded.

    Returns:
        ``((val_images (N, C, H, W), val_labels (N,)), calib_images (M, C, H, W), info)``; the
        calibration images are all of pool-train in a fixed random order
        (:func:`rafl.supernet.server_data.calibration_sample`), so any first batches mix the classes.
    Raises:
        UserInputError: an empty validation split, or a dataset whose classes do not match the
            supernet's ``n_classes``.
    """
    ds, split, info = server_dataset(meta_config, space, progress, data_root)
    val = (ds.images[split.pool_val], ds.labels[split.pool_val])
    # all of pool-train in a fixed random order: the measurement and the written subnet recalibrate BN
    # on its first batches, which must mix the classes (a class-by-class source's first images are one class)
    calib = ds.images[torch.as_tensor(calibration_sample(split.pool_train, len(split.pool_train)))]
    return val, calib, info


# ---------------------------------------------------------------------- subnet files
def save_subnet_weights(path: str | Path, subnet, space: SearchSpace) -> None:
    """Write a subnet's state dict as safetensors with ``arch`` and ``search_space`` metadata."""
    state = {k: v.detach().cpu().contiguous() for k, v in subnet.state_dict().items()}
    meta = {"format": "rafl-subnet/1", "arch": json.dumps(subnet.arch.to_dict()),
            "search_space": json.dumps(space.to_dict())}
    atomic_write_bytes(path, save_safetensors(state, metadata=meta))


def load_searched_subnet(path: str | Path):
    """Load ``subnet.safetensors`` (or a profile folder holding one) as a :class:`Subnet` (eval mode).

    Raises:
        UserInputError: missing or malformed file, or tensors that do not fit the stored arch.
    """
    path = Path(path)
    path = path / SUBNET_WEIGHTS if path.is_dir() else path
    if not path.is_file():
        raise UserInputError(f"no such file (expected {SUBNET_WEIGHTS} written by rafl search)", source=path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            state = {k: fh.get_tensor(k) for k in fh.keys()}
        space = SearchSpace.from_dict(json.loads(meta["search_space"]), source=path)
        arch = ArchConfig.from_dict(json.loads(meta["arch"]), source=path).validate(space, source=path)
    except (KeyError, json.JSONDecodeError, SafetensorError, OSError) as err:
        try:
            damage = safetensors_damage(path.read_bytes())
        except OSError:
            damage = None
        if damage is not None and damage.startswith("truncated"):
            raise UserInputError(f"{damage} (an interrupted copy or a full disk?); copy it again, or rerun rafl "
                                 "search for this profile: it rewrites the profile's folder", source=path) from None
        raise UserInputError(f"not a rafl subnet file ({damage or err.__class__.__name__}); expected the "
                             f"{SUBNET_WEIGHTS} that rafl search writes", source=path) from None
    sub = subnet_from_arch(space, arch)
    try:
        sub.load_state_dict(state)
    except RuntimeError as err:
        raise UserInputError(f"tensors do not fit arch {arch.to_string()} ({str(err).splitlines()[0]})",
                             source=path) from None
    return sub.eval()


def export_onnx(subnet, path: str | Path, sample: torch.Tensor | None = None, in_channels: int = 3
                ) -> dict[str, Any]:
    """Export ``subnet`` (eval mode) to ONNX at its resolution with a dynamic batch axis and check it.

    Input ``images``: ``(B, 3, r, r)`` float32, normalized like the training data and already
    resized to the subnet's resolution ``r``; output ``logits``: ``(B, n_classes)``. The file is
    loaded back and validated with ``onnx.checker.check_model(full_check=True)``, then run in
    onnxruntime on ``sample`` (real images ``(B, C, H, W)``, resized to ``r``; random if None) and
    compared with PyTorch.

    Returns:
        what was checked, with ``onnxruntime_max_abs_diff`` and ``onnxruntime_max_rel_diff``
        (max abs difference / max abs logit).
    Raises:
        RuntimeError: the exported model fails the checker or disagrees with PyTorch by more than
            1e-3 relative to the largest logit.
    """
    import onnx  # noqa: PLC0415 - heavy, loaded only when a subnet is exported (not by rafl profile)

    r = subnet.arch.r
    subnet = subnet.eval()
    if sample is None:
        sample = torch.randn(2, in_channels, r, r, generator=torch.Generator().manual_seed(seeds.int_seed("export-input")))
    x = prepare_input(sample[:8].float(), r).contiguous()
    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        # the tracer warns about the shape checks in Subnet's input handling (constant here)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(subnet, (x,), buf, dynamo=False, input_names=["images"], output_names=["logits"],
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
        want = subnet(x).numpy()
    data = buf.getvalue()
    model = onnx.load_from_string(data)
    onnx.checker.check_model(model, full_check=True)
    check: dict[str, Any] = {"onnx_checker": "passed (full_check)", "opset": 17,
                             "input": f"images (B, 3, {r}, {r}) float32, normalized, resized to {r} px",
                             "output": "logits (B, n_classes)"}
    try:
        import onnxruntime as ort  # noqa: PLC0415 - heavy, loaded only to check an export
    except ImportError:  # pragma: no cover - onnxruntime is a dependency
        check["onnxruntime"] = "not installed (checked with onnx only)"
    else:
        sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        got = sess.run(["logits"], {"images": x.numpy()})[0]
        diff = float(np.max(np.abs(got - want)))
        rel = diff / max(1.0, float(np.max(np.abs(want))))
        if not rel <= 1e-3:
            raise RuntimeError(f"ONNX export disagrees with PyTorch (max abs diff {diff:.3g}, relative {rel:.3g})")
        check.update(onnxruntime=f"ran {x.shape[0]} real images", onnxruntime_max_abs_diff=diff,
                     onnxruntime_max_rel_diff=rel)
    atomic_write_bytes(path, data)
    return check


def _cost_dict(cost) -> dict[str, float]:
    if hasattr(cost, "to_dict"):
        return {k: float(v) for k, v in cost.to_dict().items() if isinstance(v, (int, float))}
    if hasattr(cost, "__dataclass_fields__"):
        return {k: float(getattr(cost, k)) for k in cost.__dataclass_fields__
                if isinstance(getattr(cost, k), (int, float))}
    return {k: float(v) for k, v in dict(cost).items()}


def write_cost_report(directory: Path, arch: ArchConfig, space: SearchSpace, profile, cost, subnet=None,
                      cost_model=None) -> list[str]:
    """Write the cost model's profiling report for ``arch`` on ``profile``; return the file names.

    Always writes ``cost.json`` (the :class:`Cost`, the budgets and their violations); then the
    cost model's own report (:func:`rafl.reports.profile_report.write_profile_report`:
    ``cost_report.md/.json/.png`` with the per-layer table, fvcore/thop counts and a measured host
    latency of ``subnet``, timed 10 times).
    """
    model = cost_model if cost_model is not None else CostModel(space, profile)
    doc = {"arch": arch.to_string(), "profile": profile.name, "cost": _cost_dict(cost),
           "budgets": dict(profile.effective_budgets()), "violations": model.violations(cost, profile),
           "macs_unit": "millions of multiply-accumulates (1 MAC = 2 FLOPs)"}
    atomic_write_json(directory / "cost.json", doc)
    written = ["cost.json"]
    before = {p.name for p in directory.iterdir()}
    write_profile_report(arch, profile, directory, space=space, model=subnet, repeats=10)
    return written + sorted({p.name for p in directory.iterdir()} - before)


# ---------------------------------------------------------------------- the command
def load_search_supernet(supernet_dir: str | Path | None, progress: bool = True):
    """``(supernet, meta)``: from ``supernet_dir`` (a folder or a shipped name), or the cached
    quickstart supernet on digits."""
    if supernet_dir is None:
        supernet, path = quickstart_supernet(progress=progress)
        return supernet, load_meta(path) | {"path": str(path)}

    supernet_dir = resolve_supernet(supernet_dir)  # a shipped name (cifar10) -> its checked folder
    supernet = load_supernet(supernet_dir)
    # recorded absolute (subnet.yaml's `supernet`), so the record names it from any folder
    return supernet, load_meta(supernet_dir) | {"path": str(Path(supernet_dir).expanduser().resolve())}


def run_search(profiles: Sequence[str | Path], out: str | Path, config: SearchConfig | None = None, *,
               supernet_dir: str | Path | None = None, supernet=None, meta: dict[str, Any] | None = None,
               data_root: str | Path | None = None, remeasure: bool = False,
               say: Callable[[str], None] | None = None) -> dict[str, SearchResult]:
    """Search a subnet per device profile and write ``out/<profile>/`` (see the module docstring).

    A supernet folder with measured subnets beside its weights (``measurements.json``, shipped
    with ``cifar10``; :func:`rafl.supernet.pretrained.supernet_measurements`) is searched on them:
    the predictor trains on the recorded accuracies and the finalists found there are not
    measured again; the dataset is read only if a subnet still has to be measured (when it
    cannot be read, such a finalist keeps its predicted accuracy and ``result.json`` says so),
    and the picked subnets are BN-recalibrated on the calibration images shipped beside them.

    Args:
        profiles: shipped profile names or YAML paths (``--device-profile``).
        out: output folder. config: :class:`SearchConfig`.
        supernet_dir: a supernet directory (``rafl supernet train`` output); ``None`` with
            ``supernet=None`` uses :func:`rafl.supernet.quickstart_supernet`.
        supernet, meta: an in-memory supernet and its ``supernet.json`` content (tests, pipelines).
        data_root: where the supernet's dataset is (``--data-root``); None: the root its training
            config recorded, else ``$RAFL_DATA_ROOT`` or ``~/.cache/rafl-data``.
        remeasure: ignore the measurements beside the supernet and measure on its server-val split.
            Without it, a ``config`` that does not set ``predictor_samples`` trains the predictor on
            every subnet measured beside the supernet.
        say: called with a line for people (which measurements are used), e.g. ``click.echo`` to stderr.

    Raises:
        UserInputError: unknown or malformed profile, a supernet checkpoint that does not load or
            does not match the space, an empty validation split, unreachable budgets, altered
            shipped measurements, an ``out`` holding files that are not ``rafl search`` output
            (:data:`~rafl.stages.checks.SEARCH_OUTPUT`) or another supernet's subnets
            (:func:`check_same_supernet`). Raised before anything is written.
    """
    config = config or SearchConfig()
    if not profiles:
        raise UserInputError("give at least one --device-profile", field="device_profile")
    profs = [load_profile(p) for p in profiles]  # bad profiles fail before any work
    SEARCH_OUTPUT.check(out)
    if supernet is None:
        supernet, meta = load_search_supernet(supernet_dir, progress=config.progress)
    meta = meta or {}
    check_same_supernet(out, meta.get("path"))
    space: SearchSpace = supernet.space
    table = None
    if not remeasure and supernet_dir is not None:
        table = supernet_measurements(resolve_supernet(supernet_dir))
        if table is not None and not measured_alike(table, config.batch_size, config.calib_batches):
            table = None  # measured another way: not comparable with this search's measurements
        if table is not None and "predictor_samples" not in config.model_fields_set:
            # not chosen: the predictor trains on every subnet measured beside the supernet
            config = config.model_copy(update={"predictor_samples": max(4, int(table["predictor_samples"]["n"]))})
        if table is not None and say is not None:
            n_table = int(table["predictor_samples"]["n"])
            covered = table["predictor_samples"]["seed"] == config.seed and config.predictor_samples <= n_table
            say(f"using the {len(table['accuracy'])} subnets measured on this supernet's server-val split and shipped "
                f"beside it ({MEASUREMENTS_NAME}; predictor's Kendall tau {table['predictor_fit']['kendall_tau']:.2f}, "
                f"split-half noise ceiling {table['noise_ceiling']['kendall_tau_halves']:.2f})"
                + ("" if covered else f"; --predictor-samples {config.predictor_samples} / --seed {config.seed} "
                   f"need subnets beyond them (it holds {n_table} for seed {table['predictor_samples']['seed']}), "
                   "which are measured on the dataset")
                + "; --remeasure measures again")
    loaded: dict[str, Any] = {}

    def load_data():
        loaded["val"], loaded["calib"], loaded["info"] = server_eval_data(meta.get("config"), space,
                                                                          progress=config.progress,
                                                                          data_root=data_root)
        return loaded["val"], loaded["calib"]

    models = {p.name: CostModel(space, p) for p in profs}
    if table is None:
        load_data()
        results = search_subnets(supernet, profs, loaded["val"], loaded["calib"], config, cost_models=models)
    else:
        results = search_subnets(supernet, profs, None, None, config, cost_models=models, known=table["accuracy"],
                                 data_fn=load_data)
    if "calib" in loaded:
        calib, data_info = loaded["calib"], loaded["info"]
    else:  # searched on the shipped measurements alone: their calibration images
        calib, data_info = load_calibration(table["calibration_path"]), dict(table.get("data") or {})
    if table is not None:
        data_info["measurements"] = {"file": str(Path(table["calibration_path"]).with_name(MEASUREMENTS_NAME)),
                                     "n": len(table["accuracy"]),
                                     "measured_now": max(r.n_measured for r in results.values())}

    out = Path(out)
    run = {"supernet": meta.get("path"), "data": data_info, "config": config.model_dump()}
    names = [p.name for p in profs]

    for prof in profs:
        res = results[prof.name]
        with SEARCH_OUTPUT.write(out, entry=prof.name) as tmp, torch_threads(config.threads):
            _write_profile(tmp, res, prof, supernet, calib, config, meta, data_info, models[prof.name], names)
        write_search_index(out, run, names)  # after every folder: the index always matches the folders

    save_picks_plot(out / "pareto.png", {
        name: {"latency_ms": r.cost.latency_ms, "accuracy": r.accuracy, "predicted_accuracy": r.predicted_accuracy,
               "latency_budget_ms": r.budgets.get("latency_ms"), "arch": r.arch.to_string()}
        for name, r in results.items()}, title=f"{', '.join(names)}: the picks and their latency budgets")
    return results


def write_measurements(supernet_dir: str | Path, *, data_root: str | Path | None = None, samples: int = 500,
                       seed: int = 0, workers: int | None = None, profiles: Sequence[str] = (),
                       out: str | Path | None = None, command: str = "", say: Callable[[str], None] = print,
                       progress: bool = True, config: SearchConfig | None = None,
                       reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure what ``rafl search`` needs of a supernet and write it beside the weights
    (``measurements.json`` + ``calibration.safetensors``; read by
    :func:`rafl.supernet.pretrained.supernet_measurements`).

    The server-val split is the supernet's own, rebuilt from its recorded training config
    (:func:`server_dataset`: ``dataset``, ``public_fraction``, ``public_seed``, ``val_fraction``;
    ``data_root`` replaces the recorded data root). Measures the ``samples`` subnets of
    :func:`rafl.search.estimators.sample_across_space` (seed ``seed``: what ``rafl search
    --predictor-samples N --seed S`` trains on, for any ``N <= samples``) with the search's
    measurement (BN recalibrated on the first ``calib_batches x batch_size`` pool-train images, top-1
    on server-val; :class:`SearchConfig` defaults), in order, through the search's disk cache (an
    interrupted run resumes); then runs the search of every profile of ``profiles`` alone with the
    predictor trained on them and measures its top-k finalists too (a profile's finalists do not
    depend on the other profiles searched with it). ``config``: the search of the finalists and the
    measurement's ``batch_size`` / ``calib_batches`` (default: :class:`SearchConfig`'s, what
    ``rafl search`` uses); its ``predictor_samples``, ``seed``, ``workers`` and ``progress`` are
    replaced by the arguments. ``reuse``: an earlier document of this function for the same
    weights and measurement (:func:`rafl.supernet.pretrained.supernet_measurements`): its
    accuracies are taken as measured and kept in the document (the finalists of a changed search
    then cost a minute, not the 500 subnets again, and every subnet measured before stays a
    candidate of the search's pick: :func:`rafl.search.evolution.pick_shared`).

    Returns the document written: ``accuracy`` (canonical arch -> fraction), ``halves`` (the
    accuracy on two fixed random halves of server-val, from the same predictions),
    ``predictor_fit`` (4-fold cross-validated Kendall tau and RMSE of the predictor on the
    samples), ``noise_ceiling`` (Kendall tau between the two halves' accuracies of the samples),
    ``supernet_sha256`` (the weights measured), ``calibration`` (file and SHA-256), ``data``,
    ``measurement``, ``predictor_samples`` (``n``, ``seed``, ``archs``), ``finalists``, ``made_by``.

    Raises:
        UserInputError: no dataset at ``data_root``, an empty server-val split, a profile name that
            is not shipped (a profile no subnet fits is reported through ``say`` and skipped), a
            ``reuse`` document of other weights or another measurement.
    """
    t0 = time.perf_counter()
    folder = resolve_supernet(supernet_dir)
    out = Path(out) if out is not None else folder / MEASUREMENTS_NAME
    supernet, meta = load_search_supernet(folder, progress=False)
    space = supernet.space
    search = config
    config = dict(meta.get("config") or {})  # the supernet's training config: its server split
    if data_root is not None:
        config["data_root"] = str(data_root)
    val, calib, data_info = server_eval_data(config, space, progress=progress)
    say(f"server-val: {data_info['n_val']} images (val_fraction {data_info['val_fraction']} of the "
        f"{data_info['dataset']} public pool, as recorded in {folder / 'supernet.json'})")
    scfg = (search or SearchConfig()).model_copy(update={"seed": seed, "workers": workers, "progress": progress,
                                                         "predictor_samples": max(4, samples)})
    measured = MeasuredAccuracy(supernet, val, calib, batch_size=scfg.batch_size, calib_batches=scfg.calib_batches,
                                cache_dir=measurement_cache_dir(), workers=scfg.workers)
    for key in [k for k in measured.cache if k not in measured.halves]:  # cached before halves were recorded
        del measured.cache[key]
    if reuse is not None:
        if (reuse.get("supernet_fingerprint") != supernet_fingerprint(supernet)
                or not measured_alike(reuse, scfg.batch_size, scfg.calib_batches)
                or reuse.get("data", {}).get("n_val") != data_info["n_val"]):
            raise UserInputError("measures other weights, another server-val split or another way", field="reuse")
        measured.cache.update(reuse["accuracy"])
        measured.halves.update({k: tuple(v) for k, v in reuse["halves"].items()})
        measured._save_cache()  # the finalists' searches below read the same cache file
    archs = sample_across_space(space, samples, seed)
    t1 = time.perf_counter()
    # in blocks, in the sample's order: a run stopped early leaves a prefix of the sample measured,
    # which is the sample of a smaller count (sample_across_space is prefix-stable)
    for start in range(0, len(archs), 24):
        measured.measure(archs[: start + 24], progress=progress,
                         desc=f"measuring the predictor's subnets {start + 1}-{min(start + 24, len(archs))}")
    acc = measured.measure(archs)
    t_measure = time.perf_counter() - t1
    _, fit = train_predictor(Population.from_archs(space, archs).encode(), acc, folds=scfg.predictor_folds,
                             hidden=scfg.predictor_hidden, epochs=scfg.predictor_epochs, seed=seed)
    keys = [a.canonical(space).to_string() for a in archs]
    halves = np.asarray([measured.halves[k] for k in keys])
    ceiling = kendall_tau(halves[:, 0], halves[:, 1])
    sizes = [int(measured.half_a.sum()), int((~measured.half_a).sum())]
    say(f"predictor: Kendall tau {fit.kendall_tau:.3f} ({fit.folds}-fold CV over {len(archs)} subnets); split-half "
        f"noise ceiling: tau {ceiling:.3f} between two halves of server-val ({sizes[0]} / {sizes[1]} images)")

    finalists: dict[str, list[str]] = {}
    for name in profiles:
        try:
            res = search_subnets(supernet, [load_profile(name)], val, calib, scfg)
        except UserInputError as err:
            if "budgets" not in (err.field or ""):
                raise
            say(f"{name}: no finalists ({err.message})")
            continue
        finalists[name] = [t["arch"] for t in res[name].top_k]
        say(f"{name}: {res[name].arch.to_string()} acc {res[name].accuracy:.4f}")
    measured._load_cache()  # the searches' measurements (the same cache file)

    table = {k: measured.cache[k] for k in keys}
    for ks in finalists.values():
        for k in ks:
            table.setdefault(k, measured.cache[k])
    for k in (reuse or {}).get("accuracy", {}):  # every subnet measured before stays a candidate
        table.setdefault(k, measured.cache[k])
    n_cal = scfg.calib_batches * scfg.batch_size
    ds, split, _ = server_dataset(config, space, progress=False)
    images = ds.images.take(calibration_sample(split.pool_train, len(split.pool_train))[:n_cal])
    if not torch.equal(images[...], calib[: len(images)]):
        raise RuntimeError("the stored calibration pixels do not reproduce the calibration images")
    cal_path = out.parent / CALIBRATION_NAME
    save_calibration(cal_path, images.pixels, images.mean, images.std)
    weights = folder / "supernet.safetensors"
    doc = {
        "format": "rafl-measurements/1",
        "note": "top-1 (fraction) on the supernet's server-val split after BN recalibration on pool-train "
                "(rafl search's measurement), per canonical arch",
        "supernet_sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None,
        "supernet_fingerprint": supernet_fingerprint(supernet),
        "data": data_info,
        "measurement": {"batch_size": scfg.batch_size, "calib_batches": scfg.calib_batches},
        "calibration": {"file": CALIBRATION_NAME, "sha256": hashlib.sha256(cal_path.read_bytes()).hexdigest(),
                        "n": len(images)},
        "predictor_samples": {"n": len(archs), "seed": seed, "archs": keys},
        "finalists": finalists,
        "predictor_fit": fit.to_dict(),
        "noise_ceiling": {"kendall_tau_halves": ceiling, "half_sizes": sizes,
                          "note": "Kendall tau between the accuracies of the predictor's subnets on two fixed "
                                  "random halves of server-val (the same predictions split in two)"},
        "accuracy": table,
        "halves": {k: list(measured.halves[k]) for k in table},
        "made_by": {"command": command, "torch": torch.__version__, "machine": platform.machine(),
                    "seconds": round(time.perf_counter() - t0, 1), "measure_seconds": round(t_measure, 1)},
    }
    atomic_write_json(out, doc)
    return doc


def check_same_supernet(out: str | Path, supernet_path: str | None) -> None:
    """Refuse to search into an ``out`` whose earlier profile folders were cut from another supernet.

    ``out/search.json`` (:func:`write_search_index`) records the supernet of the folder's searches;
    a later search into the same ``out`` replaces its own profiles' folders and keeps the others,
    so a search of another supernet would leave subnets of two supernets side by side.

    Raises:
        UserInputError: ``out/search.json`` names another supernet folder than ``supernet_path``.
    """
    index = Path(out) / "search.json"
    try:
        before = json.loads(index.read_text()).get("supernet") if index.is_file() else None
    except (OSError, ValueError, AttributeError):
        return  # not readable: the index is rewritten from the folders present
    if before is not None and supernet_path is not None and before != supernet_path:
        raise UserInputError(f"holds subnets of the supernet {before}, not of {supernet_path}; search into "
                             "another folder (one --out per supernet)", source=out, field="--out")


def write_search_index(out: str | Path, run: dict[str, Any], run_profiles: Sequence[str]) -> dict[str, Any]:
    """(Re)write ``out/search.json`` atomically from the profile folders present in ``out``.

    Every ``out/<name>/result.json`` (hidden temp folders skipped) gives one entry under
    ``profiles``: this run's profiles first (in ``run_profiles`` order), then earlier searches'
    folders by name. ``run`` (``supernet``, ``data``, ``config`` of the latest run) is copied to
    the top level; ``latest_run`` lists the profiles it searched. Each entry's ``dir`` is absolute,
    as every other path rafl records (a search run from ``runs/`` into ``s1`` wrote ``s1/pi4``,
    which meant nothing from another folder). Returns the document written.
    """
    out = Path(out).expanduser().resolve()
    present = sorted(p.name for p in out.iterdir()
                     if p.is_dir() and not p.name.startswith(".") and (p / "result.json").is_file())
    order = [n for n in run_profiles if n in present] + [n for n in present if n not in run_profiles]
    entries: dict[str, Any] = {}
    for name in order:
        d = out / name
        try:
            r = json.loads((d / "result.json").read_text())
        except (OSError, ValueError):
            r = None
        if not isinstance(r, dict):
            entries[name] = {"dir": str(d), "error": "result.json is not a readable JSON object"}
            continue
        entries[name] = {"arch": r.get("arch_string"), "accuracy": r.get("accuracy"),
                         "found_for": r.get("found_for", name), "cost": r.get("cost"), "dir": str(d),
                         "supernet": r.get("supernet"), "searched_with": r.get("searched_with", [name]),
                         "latest_run": name in run_profiles}
    doc = {**run, "latest_run": list(run_profiles), "profiles": entries}
    atomic_write_json(out / "search.json", doc)
    return doc


def write_subnet_yaml(path: str | Path, arch: ArchConfig, space: SearchSpace, supernet: str | None) -> None:
    """``subnet.yaml``: the arch (``arch``, ``string``, as :meth:`ArchConfig.save` writes; read
    back by :meth:`ArchConfig.load`) plus the ``search_space`` it belongs to and the ``supernet``
    folder it came from, so that ``rafl profile --arch subnet.yaml`` profiles it in its own space."""
    atomic_write_text(path, yaml.safe_dump({"arch": arch.to_dict(), "string": arch.to_string(space),
                                            "search_space": space.to_dict(), "supernet": supernet},
                                           sort_keys=False))


def _fit_note(fit: dict[str, Any] | None) -> str | None:
    if not fit:
        return None

    return (f"Kendall tau of {fit['folds']}-fold out-of-fold predictions over {fit['n_holdout']} measured subnets: "
            f"{tau_meaning(fit['kendall_tau'])}; RMSE in accuracy (fraction)")


def same_subnet_note(results: dict[str, SearchResult]) -> list[str]:
    """One line per group of profiles that got the same subnet, saying why (no budget of theirs
    binds, so each got the best subnet the space offers them), e.g. for the digits quickstart."""
    groups: dict[str, list[str]] = {}
    for name, res in results.items():
        groups.setdefault(res.arch.to_string(), []).append(name)
    lines = []
    for names in groups.values():
        if len(names) < 2:
            continue
        why = "; ".join(f"{n}: {binding_text(results[n].budget_use)}" for n in names)
        unbound = all(results[n].binding is None for n in names)
        lines.append(f"{', '.join(names)} got the same subnet: "
                     + ("none of their budgets binds on this supernet (its subnets are cheaper than every "
                        "budget), so each gets the best subnet it can run" if unbound else
                        "it is the best measured finalist that meets each one's budgets") + f" ({why})")
    return lines


def _write_profile(d: Path, res: SearchResult, prof, supernet, calib: torch.Tensor, config: SearchConfig,
                   meta: dict[str, Any], data_info: dict[str, Any], cost_model, searched_with: list[str]) -> None:
    space = supernet.space
    write_subnet_yaml(d / "subnet.yaml", res.arch, space, meta.get("path"))
    supernet.eval()
    sub = extract_subnet(supernet, res.arch)
    batches = [calib[i:i + config.batch_size] for i in range(0, calib.shape[0], config.batch_size)]
    recalibrate_bn(sub, batches, n_batches=min(config.calib_batches, len(batches)))
    sub.eval()
    save_subnet_weights(d / SUBNET_WEIGHTS, sub, space)
    onnx_check = export_onnx(sub, d / "subnet.onnx", sample=calib[:8])
    reports = write_cost_report(d, res.arch, space, prof, res.cost, subnet=sub, cost_model=cost_model)
    atomic_write_text(d / "history.jsonl", "".join(json.dumps(h) + "\n" for h in res.history))
    out = res.outcome
    chosen = {"arch": res.arch.to_string(), "accuracy": res.accuracy,
              "estimated_accuracy": res.predicted_accuracy, **_cost_dict(res.cost)}
    if out is not None:
        save_fronts(d, out.archive_scores, out.archive_costs, lambda i: out.archive.arch(i).to_string(), chosen=chosen,
                    budgets=res.budgets, accuracy_source=res.estimator,
                    title=f"{prof.name}: {len(out.archive_scores)} feasible archs evaluated")
    atomic_write_json(d / "result.json", {
        "profile": prof.name, "arch": res.arch.to_dict(), "arch_string": res.arch.to_string(),
        "accuracy": res.accuracy, "accuracy_source": res.accuracy_source,
        "accuracy_note": ("measured top-1 (fraction) on the server's validation split after BN recalibration"
                          if res.accuracy_source == "measured" else
                          "the predictor's estimate (no data to measure this subnet on; measure it with "
                          "--remeasure and the dataset)"),
        "predicted_accuracy": res.predicted_accuracy, "estimator": res.estimator,
        "predictor_fit": res.predictor_fit, "predictor_fit_note": _fit_note(res.predictor_fit),
        "cost": _cost_dict(res.cost), "budgets": res.budgets,
        "binding_budget": res.binding, "budget_use": res.budget_use,
        "binding_note": f"the budget the pick uses to >= {int(100 * BINDING_USE)}% (null: none binds)",
        "top_k": res.top_k, "found_for": res.found_for, "searched_with": searched_with,
        "shared_candidates": res.shared_candidates,
        "generations_run": len(res.history), "onnx": onnx_check, "cost_reports": reports,
        "config": config.model_dump(), "supernet": meta.get("path"), "data": data_info,
        "search_space": space.to_dict()})


__all__ = ["run_search", "server_eval_data", "server_dataset", "load_searched_subnet", "save_subnet_weights",
           "export_onnx", "write_cost_report", "load_search_supernet", "write_search_index", "write_measurements",
           "write_subnet_yaml", "same_subnet_note", "check_same_supernet"]
