"""dooly as a library: what the CLI, the demo and the bench scripts call to answer serving questions.

* :func:`load_latency_model`: the profile DB's iteration-latency predictor for a model;
* :func:`serving_latency_model`: the same for an engine, falling back to HF eager's profiles for vLLM;
* :func:`sched_config`: the scheduler settings of one serving configuration;
* :func:`memory_model`: a model's memory model on a device of a given size;
* :func:`vllm_cpu_kv_blocks`: the KV blocks vLLM's CPU backend gives a model in a KV-cache space;
* :func:`validation_predictors`: the predictors `dooly validate` scores (the profile's, and "zero new points");
* :func:`check_calibration`: whether the DB's shared overhead fit prices a new model's forwards (``--calibrate check``);
* :func:`profile_models`: `dooly profile`'s pipeline (trace, plan, triage, time, calibrate), with its parts
  :func:`profiling_engine`, :func:`grid_spec`, :func:`calibration_policy`, :func:`traceable_models` and
  :func:`budget_triage` that `dooly plan` shares.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
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


def load_latency_model(
    model: str,
    db: Path,
    dtype: str = "bfloat16",
    threads: int | None = None,
    engine: str = DEFAULT_ENGINE,
    shape: bool = False,
    device: str = "cpu",
) -> Predictor:
    """The profile DB's iteration-latency predictor for `model` (profiled with the same engine settings);
    `shape`: signatures without a complete profile come from the shape model (after `dooly profile --budget`)."""
    from dooly.engines import get_engine
    from dooly.predict.predictor import Predictor

    if not db.exists():
        raise DoolyError(f"{db}: no such profile database (run `dooly profile {model} --db {db}` first)")
    engine_obj = get_engine(engine, device=device, dtype=dtype)
    return Predictor.for_model(model, db, engine_obj, threads=threads, shape=shape)


def serving_latency_model(
    model: str,
    db: Path,
    dtype: str,
    threads: int | None,
    engine: str,
    shape: bool = False,
    log: Callable[[str], object] | None = None,
) -> tuple[Predictor, str]:
    """`engine`'s predictor for `model`; for vLLM, the HF engine's profiles while the DB has no vLLM ones.

    Returns ``(predictor, engine that profiled the ops)``; a fallback is said through `log` (default: printed)."""
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
    model: str,
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

    config, name = resolve_model(model)[1], Path(model).stem
    limits = (memory_gb, utilization, dtype, kv_cache_dtype, activation_gb)
    return MemoryModel(config, *limits, name=name, engine=get_engine(engine, dtype=dtype))


def vllm_cpu_kv_blocks(model: str, gb: int, block_size: int, dtype: str) -> int:
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
    from dooly.profile.calibrate import CHECK_TOLERANCE, check_forwards

    name, cfg = resolve_model(model)
    try:
        pred = Predictor.for_model(model, db, engine, threads=threads, shape=True)
    except DoolyError as exc:  # e.g. signatures that failed to time: the full calibration still fits it
        return False, f"cannot predict it from the DB ({exc})"
    if set(pred.overhead.coef) != {"prefill", "decode"}:
        return False, "no shared overhead fit on this engine and hardware yet"
    measured = check_forwards(name, cfg, store, engine, context_for(engine, threads), threads=threads)
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
    without a complete profile from the shape model) and "zero new points" (the model predicted as if never
    profiled), with the error of each label that could not be built. Raises the "profile" error when neither
    could."""
    from dooly.predict.predictor import Predictor

    predictors: dict[str, Predictor] = {}
    failed: dict[str, DoolyError] = {}
    for label, kw in (("profile", {"shape": shape}), ("zero new points", {"holdout": True})):
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


def resolved_once(models: Sequence[str]) -> list[str | ModelSpec]:
    """``models`` as :class:`~dooly.core.zoo.ModelSpec`, resolved here once for the whole run; one that does not
    resolve stays as given, so its error is raised where the run reports it."""
    from dooly.core.zoo import ModelSpec, resolve_model

    out: list[str | ModelSpec] = []
    for m in models:
        try:
            name, cfg = resolve_model(m)
        except DoolyError:
            out.append(m)
        else:
            out.append(ModelSpec(name, cfg, str(m)))
    return out


def profiling_engine(engine: str, device: str, dtype: str, threads: int | None) -> tuple[Engine, int]:
    """The engine to profile with, and the torch threads (default: $DOOLY_THREADS or 1)."""
    from dooly.engines import get_engine
    from dooly.profile import default_threads

    return get_engine(engine, device=device, dtype=dtype), threads if threads is not None else default_threads()


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
    from dooly.profile.calibrate import CHECK_SUFFIX, calibrated_models

    spent = 0.0
    for m in models if policy != "none" else ():
        name, cfg = resolve_model(m)
        if policy == "check" and name not in calibrated_models(store, ctx):  # one begun resumes in full
            passed, why = check_calibration(m, db, store, engine, threads)
            spent += sum(f.cost_s for *_, f in store.forwards(ctx, name + CHECK_SUFFIX))
            verdict = "passed: no calibration of its own" if passed else "missed: full calibration"
            hooks.log(f"calibration check on {name} {verdict} ({why})")
            if passed:
                continue
        hooks.log(f"calibrating framework overhead on {name}")
        with hooks.steps(f"calibrating {name}") as steps:
            spent += calibrate(name, cfg, store, engine, ctx, threads=threads, on_step=steps)
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
) -> ProfileRun:
    """Profile every signature of ``models`` that the DB at ``db`` lacks, then calibrate each model's framework
    overhead under the ``calibration`` policy (all, check or none); safe to kill and rerun: it resumes.

    A model that cannot be traced is one line in the result's ``failed`` (the others go on); when none can,
    :class:`NothingToProfile` is raised and a DB this run created is removed. ``budget`` / ``budget_s`` leave
    the signatures the shape model predicts best unmeasured (see :func:`budget_triage`)."""
    from dooly.db.store import ProfileStore
    from dooly.profile import make_plan, run_plan, savings

    hooks = hooks or ProfileHooks()
    specs = resolved_once(models)
    engine_obj, threads = profiling_engine(engine, device, dtype, threads)
    grid_obj = grid_spec(grid)
    policy = calibration_policy(calibration)
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
