"""dooly as a library: what the CLI, the demo and the bench scripts call to answer serving questions.

* :func:`load_latency_model`: the profile DB's iteration-latency predictor for a model;
* :func:`serving_latency_model`: the same for an engine, falling back to HF eager's profiles for vLLM;
* :func:`sched_config`: the scheduler settings of one serving configuration;
* :func:`memory_model`: a model's memory model on a device of a given size;
* :func:`vllm_cpu_kv_blocks`: the KV blocks vLLM's CPU backend gives a model in a KV-cache space;
* :func:`simulate`: `dooly simulate` (one configuration, or a sweep under an SLO), saved beside the DB; a tensor x
  pipeline parallel replica's predictors by :func:`stage_latency_models` (the layout sweep over them:
  :mod:`dooly.layout_sweep`);
* :func:`validate_serving`: `dooly validate-serving`, real serving runs (HF engine or `vllm serve`) against the
  simulator, saved beside the DB;
* :func:`validation_predictors`: the predictors `dooly validate` scores (the profile's, and "zero new points");
* :func:`check_calibration`: whether the DB's shared overhead fit prices a new model's forwards (``--calibrate check``;
  its verdict on forwards already measured: :func:`check_verdict`);
* :func:`profile_models`: `dooly profile`'s pipeline (trace, plan, triage, time, calibrate), with its parts
  :func:`profiling_engine`, :func:`grid_spec`, :func:`calibration_policy`, :func:`traceable_models` and
  :func:`budget_triage` that `dooly plan` shares.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dooly.core.errors import DoolyError
from dooly.engines import DEFAULT_ENGINE

if TYPE_CHECKING:
    from dooly.core.zoo import ModelSpec
    from dooly.db.store import ProfileContext, ProfileStore
    from dooly.engines import Engine
    from dooly.predict.predictor import Predictor
    from dooly.profile import GridSpec, Plan, Savings
    from dooly.simulator import MemoryModel, SchedulerConfig
    from dooly.simulator.memory import KVSizing
    from dooly.simulator.study import Study


def load_latency_model(
    model: str | ModelSpec,
    db: Path,
    dtype: str = "bfloat16",
    threads: int | None = None,
    engine: str = DEFAULT_ENGINE,
    shape: bool = False,
    device: str = "cpu",
    tp: int = 1,
    pp: int = 1,
    pp_stage: int = 0,
    method: str = "auto",
) -> Predictor:
    """The profile DB's iteration-latency predictor for `model` (profiled with the same engine settings);
    `shape`: signatures without a complete profile come from the shape model (after `dooly profile --budget`);
    `tp` > 1: one rank of a tensor-parallel replica (its iteration is the replica's); `pp` > 1: a rank of
    pipeline stage `pp_stage` (its iteration is that stage's)."""
    from dooly.engines import get_engine
    from dooly.predict.predictor import Predictor

    if not db.exists():
        raise DoolyError(f"{db}: no such profile database (run `dooly profile {model} --db {db}` first)")
    engine_obj = get_engine(engine, device=device, dtype=dtype, tp=tp, pp=pp, pp_stage=pp_stage)
    return Predictor.for_model(model, db, engine_obj, threads=threads, shape=shape, method=method)


def serving_latency_model(
    model: str | ModelSpec,
    db: Path,
    dtype: str,
    threads: int | None,
    engine: str,
    shape: bool = False,
    log: Callable[[str], object] | None = None,
    tp: int = 1,
    pp: int = 1,
) -> tuple[Predictor, str]:
    """`engine`'s predictor for `model`; for vLLM, the HF engine's profiles while the DB has no vLLM ones.

    Returns ``(predictor, engine that profiled the ops)``; a fallback is said through `log` (default: printed).
    `tp` > 1: one rank of a tensor-parallel replica, from its own profiles (no engine to fall back to); `pp` > 1:
    a rank of the first pipeline stage (:func:`stage_latency_models` gives every stage's)."""
    if tp > 1 or pp > 1:
        return load_latency_model(model, db, dtype, threads, engine, shape, tp=tp, pp=pp), engine
    if engine != "vllm":
        return load_latency_model(model, db, dtype, threads, engine, shape), engine
    try:
        return load_latency_model(model, db, dtype, threads, "vllm", shape), "vllm"
    except (DoolyError, ImportError) as exc:  # no vLLM engine, no vLLM installed, or no profiles from it
        if log is None:
            from rich.console import Console

            log = Console().print
        log(f"[yellow]ops profiled with {DEFAULT_ENGINE}[/] (no vLLM profiles for {model}: {exc})")
        return load_latency_model(model, db, dtype, threads, DEFAULT_ENGINE, shape), DEFAULT_ENGINE


def stage_latency_models(
    model: str | ModelSpec,
    db: Path,
    dtype: str,
    threads: int | None,
    engine: str,
    shape: bool,
    tp: int,
    pp: int,
    log: Callable[[str], object] | None = None,
    method: str = "auto",
) -> tuple[list[Predictor], str]:
    """One predictor per pipeline stage of a ``tp`` x ``pp`` replica (a rank of each stage; one stage when ``pp``
    is 1 and ``method`` auto, with :func:`serving_latency_model`'s fallback), and the engine that profiled the
    ops. ``method``: the estimator (auto: chosen on the DB's points by the first stage, then kept)."""
    if pp == 1 and method == "auto":
        pred, used = serving_latency_model(model, db, dtype, threads, engine, shape, log=log, tp=tp)
        return [pred], used
    preds: list[Predictor] = []
    for s in range(pp):
        twin = _twin_stage(model, pp, s)
        if twin is not None:  # a middle stage like an earlier one: the same ops (its layers numbered apart)
            preds.append(preds[twin])
            continue
        preds.append(
            load_latency_model(model, db, dtype, threads, engine, shape, tp=tp, pp=pp, pp_stage=s, method=method)
        )
        method = preds[0].method  # the choice reads the DB's points, the same for every stage: made once
    return preds, engine


def _twin_stage(model: str | ModelSpec, pp: int, stage: int) -> int | None:
    """The earlier pipeline stage whose rank runs the same ops as ``stage``'s, if any: a middle stage (it receives
    and sends, holds neither embedding nor logits) with as many layers as stage 1 (vLLM's split)."""
    from dooly.core.zoo import num_layers, resolve_model
    from dooly.simulator.layouts import pp_partition

    if not 1 < stage < pp - 1:
        return None
    layers = num_layers(resolve_model(model)[1])
    if layers is None:
        return None
    parts = pp_partition(layers, pp)
    return 1 if parts[stage] == parts[1] else None


def replica_latency(stages: Sequence[Predictor]) -> Any:
    """The simulator's latency model of a replica: the predictor itself, or a pipeline of the stages'."""
    from dooly.simulator import PipelineLatency

    return stages[0] if len(stages) == 1 else PipelineLatency(stages)


def warm_traces(model: str | ModelSpec, db: Path, engine: str, dtype: str, tp: int, pp: int) -> None:
    """Trace every stage rank of a ``tp`` x ``pp`` replica into the DB's trace cache (when the DB is writable), so
    the predictors, which read the DB as a snapshot, do not trace it again on the next run. A deep model whose
    layers are alike is traced folded (:func:`~dooly.profile.traces.fold_traced`: the same records, far sooner)."""
    import os

    from dooly.core.zoo import resolve_model
    from dooly.db.store import ProfileStore
    from dooly.engines import get_engine
    from dooly.profile import model_traces

    if not os.access(db, os.W_OK) or not os.access(db.parent, os.W_OK):
        return
    name, cfg = resolve_model(model)
    with ProfileStore(db) as store:
        for s in range(pp):
            if _twin_stage(model, pp, s) is None:  # a deep model's alike layers traced folded (three per stage)
                model_traces(name, cfg, get_engine(engine, dtype=dtype, tp=tp, pp=pp, pp_stage=s), store, fold=True)


def sched_config(max_seqs: int, max_tokens: int, chunked: bool, block_size: int, kv_blocks: int) -> SchedulerConfig:
    """The scheduler settings of one serving configuration."""
    from dooly.simulator import SchedulerConfig

    return SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens,
        chunked_prefill=chunked,
        block_size=block_size,
        num_kv_blocks=kv_blocks,
    )


def memory_model(
    model: str | ModelSpec,
    memory_gb: float,
    utilization: float,
    dtype: str,
    kv_cache_dtype: str,
    activation_gb: float | None,
    engine: str = DEFAULT_ENGINE,
) -> MemoryModel:
    """MODEL's memory model on a device of `memory_gb` GiB (its config from the zoo or a config path)."""
    from dooly.core.zoo import resolve_model
    from dooly.engines import get_engine
    from dooly.simulator import MemoryModel

    name, config = resolve_model(model)  # the model's own name ("llama-3.1-70b", not a file stem cut at a dot)
    limits = (memory_gb, utilization, dtype, kv_cache_dtype, activation_gb)
    return MemoryModel(config, *limits, name=name, engine=get_engine(engine, dtype=dtype))


def vllm_cpu_kv_blocks(model: str | ModelSpec, gb: int, block_size: int, dtype: str) -> int:
    """vLLM CPU-backend KV blocks for MODEL; its architecture read as the memory model reads it everywhere
    (the HF engine's view of the config: vLLM builds its models from the same transformers config)."""
    from dooly.core.units import dtype_bytes
    from dooly.core.zoo import resolve_model
    from dooly.engines import get_engine
    from dooly.simulator import cpu_kv_blocks

    arch = get_engine(DEFAULT_ENGINE, dtype=dtype).architecture(resolve_model(model)[1])
    return cpu_kv_blocks(arch, gb, block_size, dtype_bytes(dtype))


def check_calibration(
    model: str | ModelSpec, db: Path, store: ProfileStore, engine: Engine, threads: int | None
) -> tuple[bool, str]:
    """``dooly profile --calibrate check``: measure the model's forwards at the check shapes (stored as
    ``NAME#check``) and compare each with what the DB predicts without any calibration of its own (the
    overhead fitted once per engine and hardware over the other models); returns (passed, one line saying why).
    The check passes when every shape lands within :data:`~dooly.profile.calibrate.CHECK_TOLERANCE` plus the
    stated uncertainty of the share of the pass predicted from shape."""
    from dooly.core.zoo import resolve_model
    from dooly.predict.predictor import Predictor
    from dooly.profile import context_for
    from dooly.profile.calibrate import check_forwards

    name, cfg = resolve_model(model)
    try:
        pred = Predictor.for_model(model, db, engine, threads=threads, shape=True)
    except DoolyError as exc:  # e.g. signatures that failed to time: the full calibration still fits it
        return False, f"cannot predict it from the DB ({exc})"
    if set(pred.overhead.coef) != {"prefill", "decode"}:
        return False, "no shared overhead fit on this engine and hardware yet"
    return check_verdict(pred, check_forwards(name, cfg, store, engine, context_for(engine, threads), threads=threads))


def check_verdict(pred: Predictor, measured: Mapping[tuple[str, str], float]) -> tuple[bool, str]:
    """Whether ``pred`` (a model priced with the shared overhead fit) predicts its ``measured`` forwards
    ({(phase, canonical point): seconds}) within the check's tolerance, and one line saying so."""
    from dooly.profile.calibrate import CHECK_TOLERANCE

    worst, parts = 0.0, []
    for (phase, point), seconds in measured.items():
        values = json.loads(point)
        err = abs(pred.forward_latency(phase, values) - seconds) / seconds
        tol = CHECK_TOLERANCE + pred.shape_share(phase, values)[1]
        worst = max(worst, err / tol)
        parts.append(f"{phase} {100 * err:.1f}% (within {100 * tol:.0f}%: {'yes' if err <= tol else 'no'})")
    what = f"shared fit of {pred.overhead.n_fit.get('decode', 0)} decode forwards vs {len(measured)} checked: "
    return worst <= 1.0, what + ", ".join(parts)


def validation_predictors(
    model: str, db: Path, engine: Engine, threads: int | None, method: str, shape: bool
) -> tuple[dict[str, Predictor], dict[str, DoolyError]]:
    """``dooly validate``'s predictors for `model`, by label: "profile" (the DB as profiled; `shape`: signatures
    without a complete profile from the shape model), "shared overhead" (its own points, the overhead fitted on
    the DB's other models: what `--calibrate none` gives) and "zero new points" (the model predicted as if never
    profiled), with the error of each label that could not be built. Raises the "profile" error when none
    could."""
    from dooly.predict.predictor import Predictor

    predictors: dict[str, Predictor] = {}
    failed: dict[str, DoolyError] = {}
    labels = (
        ("profile", {"shape": shape}),
        ("shared overhead", {"shape": shape, "shared_overhead": True}),
        ("zero new points", {"holdout": True}),
    )
    for label, kw in labels:
        try:
            predictors[label] = Predictor.for_model(model, db, engine, threads=threads, method=method, **kw)
        except DoolyError as exc:
            failed[label] = exc
    if "profile" in failed and not predictors:
        raise failed["profile"]
    return predictors, failed


# -- profiling -------------------------------------------------------------------------------------------------

#: ``steps(done, total, what)``: progress of a loop of real forwards
StepFn = Callable[[int, int, str], None]


@contextmanager
def _quiet(*_: object) -> Iterator[Callable[..., None]]:
    yield lambda *a: None


@dataclass
class ProfileHooks:
    """How :func:`profile_models` reports as it goes (the CLI draws bars on stderr; a script prints lines).

    ``log``: progress lines (stderr in the CLI; they may hold rich markup); ``report``: the budget triage's lines
    (stdout in the CLI); ``bar(title, total)``: a context giving ``advance(points)`` while the plan is timed;
    ``steps(title)``: a context giving a :data:`StepFn` while a model is calibrated."""

    log: Callable[[str], object] = print
    report: Callable[[str], object] = print
    bar: Callable[[str, int], AbstractContextManager[Callable[[int], None]]] = _quiet
    steps: Callable[[str], AbstractContextManager[StepFn]] = _quiet


@dataclass
class ProfileRun:
    """What one :func:`profile_models` run did: the plan it timed (without the signatures left to the shape
    model), those signatures, run_plan's stats, the calibration forwards' device seconds, the onboarding cost
    as the DB now records it, one line per model that could not be traced, and the seconds tracing and
    planning took."""

    plan: Plan
    predicted: set[str]
    stats: dict[str, Any]
    calib_s: float
    savings: Savings
    failed: list[str] = field(default_factory=list)
    plan_s: float = 0.0


class NothingToProfile(DoolyError):
    """No model given could be traced (each one's line in ``failed``); the DB is left as it was."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__(f"none of the {len(failed)} models given could be traced")
        self.failed = failed


def resolved(model: str | ModelSpec) -> str | ModelSpec:
    """``model`` as a :class:`~dooly.core.zoo.ModelSpec`, resolved here once for a whole command (what it is
    passed to looks nothing up again); one that does not resolve stays as given, so its error is raised where
    the command meets it."""
    from dooly.core.zoo import ModelSpec, resolve_model

    if isinstance(model, ModelSpec):
        return model
    try:
        name, cfg = resolve_model(model)
    except DoolyError:
        return model
    return ModelSpec(name, cfg, str(model))


def resolved_once(models: Sequence[str]) -> list[str | ModelSpec]:
    """``models`` as :func:`resolved`, once for the whole run."""
    return [resolved(m) for m in models]


def profiling_engine(
    engine: str, device: str, dtype: str, threads: int | None, tp: int = 1, pp: int = 1, pp_stage: int = 0
) -> tuple[Engine, int]:
    """The engine to profile with (``tp`` > 1: rank 0 of a tensor-parallel replica; ``pp`` > 1: a rank of pipeline
    stage ``pp_stage``), and the torch threads (default: $DOOLY_THREADS or 1)."""
    from dooly.engines import get_engine
    from dooly.profile import default_threads

    threads = threads if threads is not None else default_threads()
    return get_engine(engine, device=device, dtype=dtype, tp=tp, pp=pp, pp_stage=pp_stage), threads


def grid_spec(name: str) -> GridSpec:
    """The request-value grid named ``name``: default (small models on a CPU) or tiny."""
    from dooly.profile import GridSpec

    if name == "default":
        return GridSpec()
    if name == "tiny":
        return GridSpec.tiny()
    raise DoolyError(f"unknown grid {name!r} (default or tiny)")


def calibration_policy(name: str) -> str:
    """``name`` when it is a calibration policy (all, check, none), else one error naming them."""
    from dooly.profile.calibrate import CALIBRATION_POLICIES

    if name not in CALIBRATION_POLICIES:
        raise DoolyError(f"unknown --calibrate {name!r} ({', '.join(CALIBRATION_POLICIES)})")
    return name


def traceable_models(
    models: Sequence[str | ModelSpec], store: ProfileStore, engine: Engine, log: Callable[[str], object] = print
) -> tuple[list[str | ModelSpec], list[str]]:
    """The models that resolve and trace (their traces land in the store's cache, so planning does not trace
    again), and one line for each that does not: one bad model must not cost the others their plan."""
    from dooly.core.zoo import resolve_model
    from dooly.profile import model_traces

    ok, failed = [], []
    for m in models:
        try:
            name, cfg = resolve_model(m)
            log(f"tracing {name}")
            model_traces(name, cfg, engine, store)
        except DoolyError as exc:
            failed.append(f"{m}: {exc}")
        else:
            ok.append(m)
    for line in failed:
        log(f"[bold red]error:[/] {line}")
    return ok, failed


def budget_triage(
    plan: Plan, store: ProfileStore, budget: int | None, budget_s: float | None = None
) -> tuple[set[str], list[str]]:
    """The signatures left to the shape model under ``budget`` (a count) or ``budget_s`` (device seconds; none
    without either), and the lines saying what the plan reuses exactly, predicts from shape and must measure."""
    import numpy as np

    from dooly.profile.budget import triage

    if budget is not None and budget_s is not None:
        raise DoolyError("give --budget (signatures) or --budget-seconds (device time), not both")
    tr = triage(plan, store)
    measure = tr.least_certain(budget) if budget_s is None else tr.within_seconds(budget_s)
    predicted = set(tr.covered) - set(measure)
    new = len(tr.covered) + len(tr.uncovered)
    shared = len(plan.grid_size) - len(plan.in_db) - new
    unc = sorted(tr.rel_uncertainty.values())
    med = f" (median interval ±{100 * float(np.median(unc)):.0f}%)" if unc else ""
    lines = [
        f"signatures: {len(plan.grid_size)} unique over the list; {len(tr.reused)} reused exactly from "
        f"the DB; {new} new: {len(tr.covered)} predictable from shape alone{med}, {len(tr.uncovered)} of "
        f"kinds never profiled here (must be measured)"
    ]
    if shared:
        lines.append(f"  ({shared} of the new signatures are shared by several models of the list: measured once)")
    if budget is not None or budget_s is not None:
        flag = f"--budget {budget}" if budget_s is None else f"--budget-seconds {budget_s:g}"
        spent = tr.uncovered_s + sum(tr.cost_s.get(k, 0.0) for k in measure)
        lines.append(
            f"{flag}: measure {len(tr.uncovered) + len(measure)} signatures "
            f"({len(tr.uncovered)} uncovered + {len(measure)} least certain; about {spent:.1f} device-s "
            f"predicted), predict {len(predicted)} from shape"
        )
        if budget_s is not None and tr.uncovered_s > budget_s:
            lines.append(
                f"  the uncovered signatures alone are predicted to take {tr.uncovered_s:.1f} device-s, "
                f"more than --budget-seconds {budget_s:g}: they are measured anyway"
            )
    return predicted, lines


def _check_weights_fit(models: Sequence[str | ModelSpec], engine: Engine) -> None:
    """Calibration runs the whole model: refuse one too large now, not after the profiling."""
    from dooly.core.zoo import resolve_model

    for m in models:
        name, cfg = resolve_model(m)
        try:
            engine.check_weights_fit(cfg, name=name)
        except DoolyError as exc:
            raise DoolyError(f"{exc} (`--no-calibrate` profiles its operators alone)") from None


def _calibrate_all(
    models: Sequence[str | ModelSpec],
    policy: str,
    db: Path,
    store: ProfileStore,
    engine: Engine,
    ctx: ProfileContext,
    threads: int,
    hooks: ProfileHooks,
) -> float:
    """Calibrate ``models`` in order under ``policy``; returns the device seconds of their forwards."""
    from dooly.core.zoo import resolve_model
    from dooly.profile import calibrate
    from dooly.profile.calibrate import CHECK_SUFFIX, calibrate_replica, calibrated_models, replica_key

    spent = 0.0
    for m in models if policy != "none" else ():
        name, cfg = resolve_model(m)
        if replica_key(name, engine) is not None:
            tp = engine.tp  # type: ignore[attr-defined]
            hooks.log(f"calibrating framework overhead on {name}'s replica ({tp} ranks, a process each)")
            with hooks.steps(f"calibrating {name} at TP={tp}") as steps:
                spent += calibrate_replica(name, cfg, store, engine, ctx, threads=threads, on_step=steps)
            continue
        if policy == "check" and name not in calibrated_models(store, ctx):  # one begun resumes as it began
            passed, why = check_calibration(m, db, store, engine, threads)
            checked = [f.cost_s for *_, f in store.forwards(ctx, name + CHECK_SUFFIX)]
            spent += sum(checked)
            verdict = "passed: no calibration of its own" if passed else "missed: calibrated at its own depth"
            if not checked:  # nothing to check against (the DB's first model), or it cannot be priced
                verdict = "not possible: full calibration"
            hooks.log(f"calibration check on {name} {verdict} ({why})")
            if passed:
                continue
        # a check that ran and missed: its own depth, one round (the DB's first model, with nothing to check it
        # against, and every model under --calibrate all: the full set)
        light = policy == "check" and bool(store.forwards(ctx, name + CHECK_SUFFIX))
        hooks.log(f"calibrating framework overhead on {name}" + (" (its own depth, one round)" if light else ""))
        with hooks.steps(f"calibrating {name}") as steps:
            spent += calibrate(name, cfg, store, engine, ctx, threads=threads, on_step=steps, light=light)
    return spent


def profile_models(
    models: list[str],
    db: Path,
    *,
    engine: str = DEFAULT_ENGINE,
    device: str = "cpu",
    dtype: str = "bfloat16",
    threads: int | None = None,
    grid: str = "default",
    calibration: str = "all",
    budget: int | None = None,
    budget_s: float | None = None,
    ray_address: str | None = None,
    hooks: ProfileHooks | None = None,
    tp: int = 1,
    pp: int = 1,
    pp_stage: int = 0,
) -> ProfileRun:
    """Profile every signature of ``models`` that the DB at ``db`` lacks, then calibrate each model's framework
    overhead under the ``calibration`` policy (all, check or none); safe to kill and rerun: it resumes.

    A model that cannot be traced is one line in the result's ``failed`` (the others go on); when none can,
    :class:`NothingToProfile` is raised and a DB this run created is removed. ``budget`` / ``budget_s`` leave
    the signatures the shape model predicts best unmeasured (see :func:`budget_triage`). ``tp`` > 1: rank 0 of
    a tensor-parallel replica, its collectives timed between processes; calibrated (``all`` or ``check``) on the
    replica's own forwards, its ``tp`` ranks in processes of their own (:func:`calibrate_replica`). ``pp`` > 1: a
    rank of pipeline stage ``pp_stage`` (its send or receive timed between processes); not calibrated, its
    overhead is the one-device forwards' (``dooly profile`` without ``--pp``)."""
    from dooly.db.store import ProfileStore
    from dooly.profile import make_plan, run_plan, savings

    hooks = hooks or ProfileHooks()
    specs = resolved_once(models)
    engine_obj, threads = profiling_engine(engine, device, dtype, threads, tp, pp, pp_stage)
    grid_obj = grid_spec(grid)
    policy = calibration_policy(calibration)
    if pp > 1 and policy != "none":
        hooks.log(f"--tp {tp} --pp {pp}: no calibration (--calibrate {policy} is for the one-device profile)")
        policy = "none"
    elif tp > 1 and policy == "check":  # no shared fit to check a replica against: each is its own
        hooks.log(f"--tp {tp}: the replica is calibrated in full (a check needs a shared fit; replicas have none)")
        policy = "all"
    if policy != "none":
        _check_weights_fit(specs, engine_obj)
    with ProfileStore(db) as store:
        t0 = time.perf_counter()
        specs, failed = traceable_models(specs, store, engine_obj, hooks.log)
        if not specs:
            raise NothingToProfile(failed)  # inside the store: a DB this run created, with nothing measured, goes
        plan = make_plan(specs, store, engine_obj, grid_obj, threads)
        predicted: set[str] = set()
        if budget is not None or budget_s is not None:
            predicted, lines = budget_triage(plan, store, budget, budget_s)
            for line in lines:
                hooks.report(line)
            plan = plan.without(predicted)
        plan_s = time.perf_counter() - t0
        hooks.log(
            f"{len(plan.grid_size)} unique signatures; {len(plan.in_db)} skipped as already in the DB; "
            f"{len(plan.jobs)} jobs, {plan.todo_points} points to time"
        )
        with hooks.bar(f"profiling ({len(plan.in_db)} known, skipped)", plan.todo_points) as advance:

            def on_job(job: Any, _s: float) -> None:
                advance(len(job.items))

            stats = run_plan(plan, store, engine_obj, threads=threads, ray_address=ray_address, on_job=on_job)
        calib = _calibrate_all(specs, policy, db, store, engine_obj, plan.ctx, threads, hooks)
        sv = savings(plan, store, predicted, calibration=None)  # the run is over: calibration as recorded
    return ProfileRun(plan, predicted, stats, calib, sv, failed, plan_s)


# -- serving ---------------------------------------------------------------------------------------------------

VLLM_BLOCK_SIZE = 128  # vLLM's CPU backend default (it prefers multiples of 32)
SIM_WORKLOAD = "poisson:n=200,rate=2,prompt=32-512,output=8-128,seed=0"  # `dooly simulate`'s default
VALIDATE_WORKLOAD = "poisson:n=24,rate=4,prompt=16-128,output=8-24,seed=0"  # `dooly validate-serving`'s


def _silent(*_: object) -> None:
    return None


#: ``task(title, total)``: a new bar in a progress display; returns its ``advance(n)``
TaskFn = Callable[[str, int], Callable[[int], None]]


@contextmanager
def _no_bars() -> Iterator[TaskFn]:
    yield lambda title, total: _silent


@dataclass
class ServeHooks:
    """How :func:`simulate` and :func:`validate_serving` report as they go (quietly unless given these).

    ``report``: lines about the answer (stdout in the CLI: how the KV cache was sized, a fallback to HF eager's
    profiles); ``log``: progress lines (stderr in the CLI: the vLLM server's start and runs); ``bars()``: a
    context holding one progress display, giving a :data:`TaskFn` that adds a bar to it (the sweep's
    configurations; each real run's tokens, one bar per run in the one display)."""

    report: Callable[[str], object] = _silent
    log: Callable[[str], object] = _silent
    bars: Callable[[], AbstractContextManager[TaskFn]] = _no_bars


def simulate(
    model: str | ModelSpec,
    db: Path,
    *,
    workload: str = SIM_WORKLOAD,
    max_seqs: int = 32,
    max_tokens: int = 2048,
    chunked: bool = False,
    block_size: int | None = None,
    cpu_kvcache_gb: int | None = None,
    kv_blocks: int | None = None,
    memory_gb: float | None = None,
    gpu_util: float = 0.9,
    kv_cache_dtype: str = "auto",
    activation_gb: float | None = None,
    replicas: int = 1,
    router: str = "round_robin",
    router_seed: int = 0,
    sweep: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    dtype: str = "bfloat16",
    engine: str = DEFAULT_ENGINE,
    shape: bool = False,
    output: Path | None = None,
    save: bool = True,
    hooks: ServeHooks | None = None,
    tp: int = 1,
    pp: int = 1,
) -> Study:
    """`dooly simulate`: serve ``workload`` (a trace file or a generator spec) on MODEL in the simulator, its
    iteration latencies from the profiles in ``db``; at one configuration, or with ``sweep`` over the config
    grid around it under an SLO on p90 TTFT / TPOT (seconds). ``engine="vllm"`` runs vLLM v1's scheduler.

    KV blocks per replica: ``kv_blocks``, else vLLM's CPU backend's in ``cpu_kvcache_gb``, else derived from a
    device of ``memory_gb`` GiB as vLLM does, else 4096. The study's payload is saved beside the DB (``save``);
    ``output`` gets its CSV (the sweep table, or the per-request metrics). ``tp`` > 1: a replica of ``tp`` devices
    (vLLM), its iteration one rank's; ``cpu_kvcache_gb`` and ``memory_gb`` are per device (:func:`kv_devices`).
    ``pp`` > 1: a replica of ``pp`` pipeline stages of ``tp`` devices each, every stage's iteration its own rank's,
    up to ``pp`` batches in flight as vLLM v1 keeps them (:mod:`dooly.simulator.simulator`)."""
    from dooly.report import save_result, write_sweep_csv
    from dooly.simulator import make_router, parse_workload
    from dooly.simulator.memory import DEFAULT_KV_BLOCKS
    from dooly.simulator.search import SLO, config_grid
    from dooly.simulator.study import run_study

    hooks = hooks or ServeHooks()
    make_router(router)  # an unknown name fails before any work
    w = parse_workload(workload)
    spec = resolved(model)  # the KV sizing, the memory model and the predictor all read this one
    chunked = chunked or engine == "vllm"  # vLLM v1's scheduler always chunks prefills
    block_size = block_size or (VLLM_BLOCK_SIZE if engine == "vllm" else 16)
    if cpu_kvcache_gb is not None and kv_blocks is None:
        # vLLM's CPU backend sets this space aside on every rank; a stage caches its own layers only
        kv_gb = cpu_kvcache_gb * kv_devices(spec, tp) * pp
        kv_blocks = vllm_cpu_kv_blocks(spec, kv_gb, block_size, dtype)
        hooks.report(f"KV cache: {kv_blocks} blocks of {block_size} tokens in {kv_gb} GiB (vLLM CPU backend)")
    mem = None
    if memory_gb is not None:  # each rank holds 1/(tp x pp) of the weights: the replica has tp x pp devices' memory
        mem = memory_model(spec, memory_gb * tp * pp, gpu_util, dtype, kv_cache_dtype, activation_gb, engine)
    cfg = sched_config(max_seqs, max_tokens, chunked, block_size, DEFAULT_KV_BLOCKS)
    kv = _size_kv_cache(cfg, mem, kv_blocks, hooks.report)
    latency, _ = replica_latency_model(spec, db, dtype, None, engine, shape, tp, pp, cfg, hooks.report)
    args: dict[str, Any] = dict(model=str(model), workload_spec=workload, workload=w, latency=latency, kv=kv)
    args.update(memory=mem, replicas=replicas, router=router, router_seed=router_seed)
    if sweep:
        configs = config_grid(kv.config)
        with hooks.bars() as task:
            advance = task("simulating configs", len(configs))
            study = run_study(**args, slo=SLO(slo_ttft, slo_tpot), configs=configs, progress=lambda: advance(1))
    else:
        study = run_study(**args)
    if save:
        save_result(db, f"simulation-{Path(str(model)).stem}", study.payload())
    if output and sweep:
        write_sweep_csv(study.points, output)
    elif output:
        study.result.metrics.save_csv(output)
    return study


def replica_latency_model(
    spec: str | ModelSpec,
    db: Path,
    dtype: str,
    threads: int | None,
    engine: str,
    shape: bool,
    tp: int,
    pp: int,
    cfg: SchedulerConfig,
    report: Callable[[str], object],
) -> tuple[Any, str]:
    """The simulator's latency model of a ``tp`` x ``pp`` replica (`dooly simulate` and `validate-serving`): the
    stages' predictors (traces warmed first with stages), each parallel rank's collectives' share reported; and
    the engine that profiled the ops."""
    if pp > 1:
        warm_traces(spec, db, engine, dtype, tp, pp)
    stages, used = stage_latency_models(spec, db, dtype, threads, engine, shape, tp, pp, log=report)
    if tp > 1 or pp > 1:
        for s, pred in enumerate(stages):
            report((f"stage {s}: " if pp > 1 else "") + collectives_line(pred, cfg))
        for note in dict.fromkeys(n for pred in stages for n in pred.collective_notes):
            report(f"collectives: {note}")
    return replica_latency(stages), used


def kv_devices(model: str | ModelSpec, tp: int) -> int:
    """How many devices' worth of KV cache a replica of ``tp`` ranks holds: each rank caches its share of the KV
    heads (vLLM repeats a head on several ranks when there are fewer KV heads than ranks)."""
    from dooly.core.zoo import resolve_model

    if tp == 1:
        return 1
    cfg = resolve_model(model)[1]
    cfg = cfg.get("text_config") or cfg
    heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or tp)
    return heads // max(1, heads // tp)


def collectives_line(pred: Predictor, cfg: SchedulerConfig, kv_len: int = 256) -> str:
    """The share of a rank's operator time its collectives take, in a full prefill iteration and a full decode."""
    tokens, seqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
    pre = pred.collectives_share("prefill", {"requests": 1, "tokens": tokens})
    dec = pred.collectives_share("decode", {"requests": seqs, "kv_len": kv_len})
    return (
        f"collectives: {100 * pre:.1f}% of a rank's operator time in a prefill of {tokens} tokens, "
        f"{100 * dec:.1f}% in a decode of {seqs} requests at KV {kv_len}"
    )


def _size_kv_cache(
    cfg: SchedulerConfig, mem: MemoryModel | None, kv_blocks: int | None, report: Callable[[str], object]
) -> KVSizing:
    """``cfg``'s KV cache per replica (see :func:`~dooly.simulator.memory.size_kv_cache`), reported when the
    memory model planned it."""
    from dooly.simulator.memory import size_kv_cache

    kv = size_kv_cache(cfg, mem, kv_blocks)
    if kv.plan is not None:
        report(f"KV cache: {kv.plan.describe()}")
        if kv.explicit:
            report(
                f"KV cache: {kv_blocks} blocks per replica from --num-kv-blocks "
                f"(memory would give {kv.plan.num_blocks})"
            )
        else:
            report(f"KV cache: {kv.plan.num_blocks} blocks per replica, derived from memory")
    return kv


def validate_serving(
    model: str | ModelSpec,
    db: Path,
    *,
    workload: str = VALIDATE_WORKLOAD,
    max_seqs: int = 8,
    max_tokens: int = 512,
    chunked: bool = False,
    block_size: int | None = None,
    kv_blocks: int = 4096,
    cpu_kvcache_gb: int = 1,
    threads: int | None = None,
    dtype: str = "bfloat16",
    clock: str | None = None,
    real_runs: int = 2,
    warmup_runs: int = 1,
    engine: str = DEFAULT_ENGINE,
    device: str = "cpu",
    save: bool = True,
    hooks: ServeHooks | None = None,
    tp: int = 1,
    pp: int = 1,
) -> tuple[dict[str, Any], Path | None]:
    """`dooly validate-serving`: serve ``workload`` on the real engine ``real_runs`` times, simulate it from the
    profiles in ``db``, and score the simulation; returns the payload and where it was saved beside the DB
    (``save``; else None).

    HF engines serve in-process at the scheduler settings given (``kv_blocks`` blocks of ``block_size``, default
    16), timed with ``clock`` (default: the profiles' clock); ``engine="vllm"`` starts the real `vllm serve` on
    its CPU backend (KV cache ``cpu_kvcache_gb`` GiB, blocks of 128 by default) after ``warmup_runs`` unscored.
    ``threads``: the engine's torch threads (default: $DOOLY_THREADS or 1, as the profiler), per rank.
    ``tp`` / ``pp`` > 1 (vllm): a real ``tp`` x ``pp`` replica, ``threads`` cores per rank, simulated with the
    replica's predictor as `dooly simulate --tp --pp` builds it (the DB must hold the ranks' profiles)."""
    import os

    from dooly.profile import default_clock, default_threads
    from dooly.report import save_result

    hooks = hooks or ServeHooks()
    threads = threads if threads is not None else default_threads()
    spec = resolved(model)  # the predictor, the served model and the server's config all read this one
    stem = Path(str(model)).stem
    if tp * pp > 1:
        flag = f"--tp {tp} --pp {pp}"
        if engine != "vllm":
            raise DoolyError(f"validate-serving {flag} serves a parallel replica with `vllm serve`: give --engine vllm")
        cores = len(os.sched_getaffinity(0))
        if tp * pp * threads > cores:
            raise DoolyError(
                f"validate-serving {flag}: {tp * pp} ranks of {threads} thread(s) need {tp * pp * threads} cores, "
                f"dooly has {cores} here"
            )
    if engine == "vllm":
        if device != "cpu":
            raise DoolyError("validate-serving --engine vllm serves with vLLM's CPU backend; drop --device")
        limits = (max_seqs, max_tokens, block_size or VLLM_BLOCK_SIZE, cpu_kvcache_gb)
        run = (real_runs, warmup_runs, tp, pp)
        payload = _validate_vllm(spec, db, workload, limits, threads, dtype, run, hooks)
        name = f"validation-{stem}-vllm{max_tokens}-seqs{max_seqs}" + (f"-tp{tp}pp{pp}" if tp * pp > 1 else "")
    else:
        clock = clock if clock is not None else default_clock(device, threads)
        cfg = sched_config(max_seqs, max_tokens, chunked, block_size or 16, kv_blocks)
        payload = _validate_hf(spec, db, workload, cfg, threads, dtype, clock, real_runs, engine, device, hooks)
        name = f"validation-{stem}-{'chunked' if chunked else 'whole'}{max_tokens}-seqs{max_seqs}"
    return payload, save_result(db, name, payload) if save else None


def _validate_hf(
    model: str | ModelSpec,
    db: Path,
    workload: str,
    cfg: SchedulerConfig,
    threads: int,
    dtype: str,
    clock: str,
    real_runs: int,
    engine: str,
    device: str,
    hooks: ServeHooks,
) -> dict[str, Any]:
    """Serve ``workload`` on the real HF engine ``real_runs`` times, simulate it from the profiles, return the
    payload. The simulator is scored against each request's median over the real runs; the runs' own spread is
    reported beside it (the noise floor: no prediction agrees with a run better than the runs agree)."""
    import numpy as np

    from dooly.core.zoo import resolve_model
    from dooly.engines import get_engine
    from dooly.serve.serving import average_runs, compare, percentile_scores, pooled_itl, request_spread, serve
    from dooly.simulator import CachedLatency, parse_workload
    from dooly.simulator import simulate as run_sim

    w = parse_workload(workload)
    latency = CachedLatency(load_latency_model(model, db, dtype, threads, engine, device=device))
    eng = get_engine(engine, device=device, dtype=dtype)
    served = eng.build_model(resolve_model(model)[1])
    runs = []
    with hooks.bars() as task:
        for k in range(real_runs):
            advance = task(f"serving {len(w)} requests on {model} (real run {k + 1}/{real_runs})", int(w.output.sum()))
            runs.append(serve(w, served, cfg, eng, threads=threads, on_iteration=_tokens(advance), clock=clock))
    measured = average_runs(runs)
    simulated = run_sim(w, latency, cfg)
    v = compare(measured, simulated, latency)
    pred = [latency.iteration_latency(b.to_batch()) for b in measured.batches]
    return {
        "kind": "validation",
        "model": str(model),
        "workload": workload,
        "config": cfg.label(),
        "threads": threads,
        "clock": clock,
        "percentiles": percentile_scores(
            [(r.metrics, pooled_itl(r.requests)) for r in runs], simulated.metrics, pooled_itl(simulated.requests)
        ),
        "table": v.rows,
        "iteration_mape": v.iteration_mape,
        "real_runs": real_runs,
        "run_to_run_pct": request_spread(runs),
        "measured": {"ttft": measured.metrics.ttft, "tpot": measured.metrics.tpot, "e2e": measured.metrics.e2e},
        "simulated": {"ttft": simulated.metrics.ttft, "tpot": simulated.metrics.tpot, "e2e": simulated.metrics.e2e},
        "iterations": {"measured": np.array([it.end - it.start for it in measured.iterations]), "predicted": pred},
    }


def _tokens(advance: Callable[[int], None]) -> Callable[[Any], None]:
    """A real run's ``on_iteration``: advance the bar by the tokens the iteration ran."""
    return lambda it: advance(it.num_decode + it.num_prefill)


def _validate_vllm(
    model: str | ModelSpec,
    db: Path,
    workload: str,
    limits: tuple[int, int, int, int],
    threads: int,
    dtype: str,
    run: tuple[int, int, int, int],
    hooks: ServeHooks,
) -> dict[str, Any]:
    """The real `vllm serve` under vLLM's load generator vs the simulator running vLLM v1's scheduler (see
    :mod:`dooly.serve.vllm_serving`); ``limits``: max seqs, max batched tokens, block size, KV-cache GiB (per
    rank); ``run``: real runs, warm-up runs, tensor-parallel size, pipeline stages."""
    from dooly.serve.vllm_serving import ServeConfig, validate, vllm_available
    from dooly.simulator import CachedLatency, PipelineLatency, parse_workload, vllm_v1_config

    why = vllm_available()
    if why:
        raise DoolyError(why)
    max_seqs, max_tokens, block_size, kvcache_gb = limits
    real_runs, warmup_runs, tp, pp = run
    w = parse_workload(workload)
    # vLLM's CPU backend sets the space aside on every rank; a stage caches its own layers only (as `simulate`)
    blocks = vllm_cpu_kv_blocks(model, kvcache_gb * kv_devices(model, tp) * pp, block_size, dtype)
    cfg = vllm_v1_config(max_seqs, max_tokens, block_size, blocks)
    try:
        latency, profiled_with = replica_latency_model(
            model, db, dtype, threads, "vllm", False, tp, pp, cfg, hooks.report
        )
    except DoolyError as exc:
        if tp * pp == 1:
            raise
        raise DoolyError(_rank_profile_hint(str(exc), model, db, tp, pp)) from None
    longest = int((w.prompt + w.output).max())
    max_len = max(256, -(-longest // block_size) * block_size)  # the longest request, in whole blocks
    serve_cfg = ServeConfig(
        max_seqs, max_tokens, block_size, kvcache_gb, dtype, threads, max_model_len=max_len, tp=tp, pp=pp
    )
    if not isinstance(latency, PipelineLatency):  # a pipeline caches each stage itself
        latency = CachedLatency(latency)
    payload = validate(model, w, serve_cfg, blocks, latency, real_runs, log=hooks.log, warmup_runs=warmup_runs)
    payload["workload"] = workload
    payload["profiled_with"] = profiled_with
    return payload


def _rank_profile_hint(message: str, model: str | ModelSpec, db: Path, tp: int, pp: int) -> str:
    """``message`` with the `dooly profile` command it suggests replaced by the ones that profile the replica's
    ranks (one per pipeline stage): the predictor's own hint names the one-device profile."""
    import re

    from dooly.core.zoo import ModelSpec
    from dooly.db.store import profile_command

    base = profile_command(model, db, model.name if isinstance(model, ModelSpec) else str(model))
    flags = [f"--engine vllm --tp {tp}" + (f" --pp {pp} --pp-stage {s}" if pp > 1 else "") for s in range(pp)]
    cmds = " and ".join(f"`{base} {f}`" for f in flags)
    return re.sub(r"`dooly profile [^`]*`", lambda _: cmds, message)  # other errors (vLLM's refusals) as they are
