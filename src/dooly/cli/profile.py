"""`dooly profile`, `dooly plan`, `dooly validate`: the profile database and the latency predictor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from dooly.cli.app import app
from dooly.engines import DEFAULT_ENGINE

out = Console()
err = Console(stderr=True)

#: A validation whose rounds disagree by more than this (%) on average ran on a busy machine: `validate` says so
#: (this 2-vCPU VM: 1-5% when quiet, up to 17% in a noisy hour).
NOISY_SPREAD_PCT = 10.0

_DB = typer.Option(
    Path("profiles.db"), "--db", help="Profile database (SQLite file; `dooly profile` creates it, others only read)."
)
_THREADS = typer.Option(None, "--threads", help="torch threads while timing (default: $DOOLY_THREADS or 1).")
_DEVICE = typer.Option("cpu", "--device", help="cpu, cuda or auto.")
_DTYPE = typer.Option("bfloat16", "--dtype", help="Weight/activation dtype of the engine.")
_GRID = typer.Option("default", "--grid", help="Request-value grid: default (small models on a CPU) or tiny.")
_ENGINE = typer.Option(DEFAULT_ENGINE, "--engine", help="Inference engine: hf-eager (default) or vllm.")
_BUDGET = typer.Option(
    None,
    "--budget",
    min=0,
    help="Measure at most N of the new signatures the shape model can predict (the least certain first); "
    "the rest are predicted from shape (validate with --shape). Signatures no shape model covers are always "
    "measured. Default: measure every new signature.",
)
_CALIBRATE = typer.Option(
    "all",
    "--calibrate",
    metavar="POLICY",
    help="Calibration forwards (real forwards that fit the framework overhead): all (every model, at its depth and "
    "half of it, two rounds), check (one forward per phase against the overhead fitted on the DB's other models; "
    "if it misses, one round at the model's own depth), or none (the shared fit, unchecked).",
)
_BUDGET_S = typer.Option(
    None,
    "--budget-seconds",
    min=0.0,
    metavar="S",
    help="As --budget, but a cap on predicted profiling device time: the signatures no shape model covers are "
    "measured first, then the least certain of the rest while their predicted cost fits in S seconds.",
)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _Steps:
    """Progress of a long loop of real forwards (calibration, validation): a bar with the time left on a terminal,
    else (a log) a plain line at the first step, at least once a minute after, and at the last.

    Called as ``steps(done, total, what)``; a ``with`` block shows the bar."""

    EVERY_S = 60.0

    def __init__(self, title: str, unit: str = "shapes") -> None:
        self.title, self.unit = title, unit
        self.bar: Progress | None = None
        self.task = None
        self.t0 = self.last = 0.0

    def __enter__(self) -> _Steps:
        import time

        self.t0 = time.monotonic()
        self.last = -self.EVERY_S
        if err.is_terminal:
            columns = (MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), *columns, console=err)
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, done: int, total: int, what: str) -> None:
        import time

        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task(self.title, total=total)
            desc = f"{self.title}: {what}" if what else self.title
            self.bar.update(self.task, completed=done, total=total, description=desc)
            return
        now = time.monotonic()
        if now - self.last < self.EVERY_S and 0 < done < total:
            return
        self.last, elapsed = now, now - self.t0
        left = f", about {_clock(elapsed / done * (total - done))} left" if 0 < done < total else ""
        line = f"{time.strftime('%H:%M:%S')} {self.title}: {done}/{total} {self.unit}, {_clock(elapsed)} elapsed{left}"
        err.print(f"{line} ({what})" if what else line, highlight=False, soft_wrap=True)


def _fail_if(failed: list[str]) -> None:
    if failed:
        err.print(f"{len(failed)} of the models given could not be traced (see above); exit status 1")
        raise typer.Exit(1)


def _log(line: str) -> None:
    err.print(line, highlight=False, soft_wrap=True)


_SAVINGS_COLS = ("model", "signatures", "new", "reused (list)", "reused (DB)", "trace s", "profile alone s")
_SAVINGS_COLS += ("profile s", "calibrate alone s", "calibrate s", "alone s", "with reuse s")


def _print_savings(plan, sv) -> None:  # type: ignore[no-untyped-def]
    """The plan's onboarding cost per model (``sv``: :func:`dooly.profile.savings` of the plan)."""
    t = Table(title=f"onboarding plan ({plan.ctx.hardware}, {plan.ctx.engine}, {plan.ctx.dtype})")
    for col in _SAVINGS_COLS:
        t.add_column(col, justify="right" if col != "model" else "left")
    for r in sv.models:
        costs = (r.trace_s, r.profile_alone_s, r.profile_s, r.calib_alone_s, r.calib_s, r.alone_s, r.marginal_s)
        t.add_row(
            r.name, str(r.signatures), str(r.new), str(r.reused_models), str(r.reused_db), *(f"{c:.1f}" for c in costs)
        )
    out.print(t)
    out.print(f"onboarding cost: {sv.describe()}")
    out.print(
        f"to profile now: {len(plan.jobs)} jobs, {plan.todo_points} points; "
        f"{len(plan.in_db)} signatures already in the DB"
    )


def _print_calibration(models: list[str], store, ctx, policy: str) -> None:  # type: ignore[no-untyped-def]
    """One line per model: the calibration it will take under ``policy``, and why."""
    from dooly.core.zoo import resolve_model
    from dooly.profile.calibrate import calibration_needs

    needs = calibration_needs(store, ctx, dict(resolve_model(m) for m in models), policy)
    out.print(f"calibration (--calibrate {policy}):")
    for name, line in needs.items():
        out.print(f"  {name}: {line}", highlight=False, soft_wrap=True)


@app.command("plan")
def plan_cmd(
    models: list[str] = typer.Argument(..., help="Zoo names, config.json paths or model directories."),
    db: Path = _DB,
    threads: int | None = _THREADS,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    grid: str = _GRID,
    engine_name: str = _ENGINE,
    budget: int | None = _BUDGET,
    budget_s: float | None = _BUDGET_S,
    calibration: str = _CALIBRATE,
) -> None:
    """Print what profiling MODELS would measure, what it reuses exactly, what it can predict from shape
    alone, what calibration each model needs, and the onboarding cost with vs without reuse."""
    from dooly.api import (
        budget_triage,
        calibration_policy,
        grid_spec,
        profiling_engine,
        resolved_once,
        traceable_models,
    )
    from dooly.db.store import ProfileStore
    from dooly.profile import make_plan, savings

    calibration_policy(calibration)
    engine, threads = profiling_engine(engine_name, device, dtype, threads)
    grid_obj = grid_spec(grid)
    with ProfileStore(db, readonly=True) as store:  # planning writes nothing (traces are cached in memory)
        ok, failed = traceable_models(resolved_once(models), store, engine, _log)
        if ok:
            plan = make_plan(ok, store, engine, grid_obj, threads)
            _print_savings(plan, savings(plan, store, calibration=calibration))
            if calibration == "check":
                miss = savings(plan, store, calibration=calibration, missed=[m.name for m in plan.models])
                out.print(
                    f"  (every check passing; were every check to miss: {miss.with_reuse_s:.1f} device-s with reuse, "
                    f"{miss.saved_pct:.1f}% saved)"
                )
            _print_calibration(ok, store, plan.ctx, calibration)
            predicted, lines = budget_triage(plan, store, budget, budget_s)
            for line in lines:
                out.print(line)
            if predicted:
                flag = f"--budget {budget}" if budget_s is None else f"--budget-seconds {budget_s:g}"
                left = plan.without(predicted)
                out.print(f"with {flag}: {len(left.jobs)} jobs, {left.todo_points} points to time")
                sv = savings(plan, store, predicted, calibration)
                out.print(f"onboarding cost with {flag}: {sv.describe()}")
    _fail_if(failed)


@contextmanager
def _points_bar(title: str, total: int) -> Iterator[Callable[[int], None]]:
    """`profile`'s progress over the points to time (a bar on a terminal, else a line at least once a minute)."""
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        steps(done, total, "")

    with _Steps(title, unit="points") as steps:
        steps(0, total, "")
        yield advance


@app.command("profile")
def profile_cmd(
    models: list[str] = typer.Argument(..., help="Zoo names, config.json paths or model directories."),
    db: Path = _DB,
    threads: int | None = _THREADS,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    grid: str = _GRID,
    ray_address: str | None = typer.Option(None, "--ray-address", help="Spread the jobs over a Ray cluster."),
    calibration: str = _CALIBRATE,
    no_calibrate: bool = typer.Option(False, "--no-calibrate", help="The same as --calibrate none."),
    engine_name: str = _ENGINE,
    budget: int | None = _BUDGET,
    budget_s: float | None = _BUDGET_S,
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Profile rank 0 of a tensor-parallel replica (vllm): its collectives timed between processes, its "
        "overhead calibrated on the replica's own forwards (a process per rank).",
    ),
    pp: int = typer.Option(1, "--pp", min=1, help="Pipeline stages of the replica (vllm); profile one stage's rank."),
    pp_stage: int = typer.Option(0, "--pp-stage", min=0, help="With --pp: which stage's rank to profile (0-based)."),
) -> None:
    """Profile every signature of MODELS that the DB lacks (safe to kill and rerun: it resumes)."""
    from dooly.api import NothingToProfile, ProfileHooks, profile_models

    hooks = ProfileHooks(log=_log, report=out.print, bar=_points_bar, steps=_Steps)
    kw = {"engine": engine_name, "device": device, "dtype": dtype, "threads": threads, "grid": grid}
    kw |= {"calibration": "none" if no_calibrate else calibration, "budget": budget, "budget_s": budget_s, "tp": tp}
    kw |= {"pp": pp, "pp_stage": pp_stage}
    try:
        run = profile_models(models, db, ray_address=ray_address, hooks=hooks, **kw)
    except NothingToProfile as exc:
        _fail_if(exc.failed)
        raise
    stats, plan = run.stats, run.plan
    for f in stats["failures"][:10]:
        err.print(f"[yellow]could not time[/] {f}")
    out.print(
        f"profiled {stats.get('points', plan.todo_points)} points in {stats['device_s']:.1f} device-s "
        f"({stats['wall_s']:.1f} s wall); {stats['completed']} signatures completed; "
        f"calibration forwards {run.calib_s:.1f} s"
    )
    _print_savings(plan, run.savings)
    if run.predicted:
        out.print(
            f"{len(run.predicted)} signatures left to the shape model (not measured): validate and "
            f"predict with `--shape`"
        )
    _fail_if(run.failed)


def _measure(name: str, pred, cfg, engine, keep_in: Path | None, **kw):  # type: ignore[no-untyped-def]
    """`validate`'s held-out forwards, with progress (stored in ``keep_in`` when given)."""
    from dooly.db.store import ProfileStore
    from dooly.predict.validate import validate_model
    from dooly.predict.validate_parallel import validate_parallel

    # a rank of a parallel replica: the whole replica's forwards, its ranks in processes of their own
    measure = validate_parallel if getattr(engine, "tp", 1) * getattr(engine, "pp", 1) > 1 else validate_model
    err.print(f"measuring {name}")
    with _Steps(f"measuring {name}") as steps:
        if keep_in is None:
            return measure(pred, cfg, engine, on_step=steps, **kw)
        with ProfileStore(keep_in) as store:
            return measure(pred, cfg, engine, store=store, on_step=steps, **kw)


@app.command("validate")
def validate_cmd(
    model: str = typer.Argument(..., help="Zoo name, config.json path or model directory."),
    db: Path = _DB,
    threads: int | None = _THREADS,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    method: str = typer.Option("auto", "--method", help="interp, forest or auto (lower held-out error)."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs per held-out shape and round (median)."),
    rounds: int = typer.Option(
        2, "--rounds", min=1, help="Measure every shape this many times, interleaved; their spread is the noise floor."
    ),
    engine_name: str = _ENGINE,
    shape: bool = typer.Option(
        False,
        "--shape/--no-shape",
        help="Predict signatures without a complete profile from the shape model of their operator kind "
        "(after `dooly profile --budget`, or for a model never profiled).",
    ),
    keep: bool = typer.Option(
        False,
        "--keep/--no-keep",
        help="Store the held-out measurements in the DB (as MODEL#holdout, never fitted on); a later `--keep` "
        "run re-scores them without measuring again (after a new profile or predictor change, on this machine).",
    ),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Score rank 0 of a tensor-parallel replica (vllm) against the real replica's forwards "
        "(its ranks in processes of their own, one per core; after `dooly profile --tp`).",
    ),
    pp: int = typer.Option(
        1,
        "--pp",
        min=1,
        help="Score a replica of this many pipeline stages (vllm): the stages' predictors summed against the real "
        "stages' forward (after `dooly profile --pp M --pp-stage S` for each stage).",
    ),
) -> None:
    """Measure real forwards of MODEL at held-out shapes and print the predictor's MAPE per phase.

    Beside the MAPE it prints the run-to-run spread: how far two rounds of measuring the same shapes land
    apart on this machine. A prediction cannot agree with a measurement better than that. Beside the
    profile's own figure it prints "shared overhead" (its own points, the overhead fitted on the DB's other
    models, as `--calibrate none` leaves it) and "zero new points": the model predicted as if it had never been
    profiled (signatures no other model needs, and its calibration forwards, left out of every fit).
    """
    from dooly.api import profiling_engine, validation_predictors
    from dooly.core.errors import DoolyError
    from dooly.core.zoo import resolve_model
    from dooly.db.store import profile_command

    if not db.exists():
        raise DoolyError(f"{db}: no such profile database (run `{profile_command(model, db, model)}` first)")
    engine, threads = profiling_engine(engine_name, device, dtype, threads, tp=tp, pp=pp)
    name, cfg = resolve_model(model)
    if pp > 1:
        _validate_stages(model, name, cfg, db, engine, dtype, threads, method, shape, keep, repeats, rounds)
        return
    if method == "auto":
        _print_method_errors(db, engine, threads)
    predictors, failed = validation_predictors(model, db, engine, threads, method, shape)
    for label, exc in failed.items():
        err.print(f"no {label} figure: {exc}", highlight=False, soft_wrap=True)
    _print_shape_shares(predictors)
    pred = next(iter(predictors.values()))
    rows = _measure(name, pred, cfg, engine, db if keep else None, threads=threads, repeats=repeats, rounds=rounds)
    others = {label: [p.forward_latency(r.phase, r.values) for r in rows] for label, p in predictors.items()}
    _print_validation(name, rows, predictors, others)
    _print_mapes(rows, others, shape)
    if rounds > 1:
        _print_spread(rows)


def _validate_stages(  # type: ignore[no-untyped-def]
    model, name, cfg, db, engine, dtype, threads, method, shape, keep, repeats, rounds
) -> None:
    """`validate --pp M`: the stages' predictors, summed, against the real stages' forward (the profile's figure
    only: "shared overhead" and "zero new points" are one engine's, not a pipeline's)."""
    from dooly.api import stage_latency_models

    tp, pp = engine.tp, engine.pp
    stages, _ = stage_latency_models(model, db, dtype, threads, "vllm", shape, tp, pp, method=method)
    _print_shape_shares({f"stage {i}": p for i, p in enumerate(stages)})
    rows = _measure(name, stages, cfg, engine, db if keep else None, threads=threads, repeats=repeats, rounds=rounds)
    others = {"profile": [r.predicted_s for r in rows]}
    _print_validation(name, rows, {"profile": stages[0]}, others)
    _print_mapes(rows, others, shape)
    if rounds > 1:
        _print_spread(rows)


def _print_method_errors(db: Path, engine, threads: int) -> None:  # type: ignore[no-untyped-def]
    """``--method auto``: the held-out grid-line MAPE of each predictor method over the DB's points."""
    from dooly.db.store import ProfileStore
    from dooly.predict.estimators import method_errors
    from dooly.profile import context_for

    with ProfileStore(db, readonly=True) as store:
        raw = store.all_points(context_for(engine, threads))
    errs = method_errors({k: [(p, m.median_s) for p, m in v] for k, v in raw.items()})
    if errs["interp"]:
        import numpy as np

        out.print(
            f"held-out grid-line MAPE: interp {100 * np.mean(errs['interp']):.1f}%, "
            f"forest {100 * np.mean(errs['forest']):.1f}%"
        )


def _print_shape_shares(predictors) -> None:  # type: ignore[no-untyped-def]
    """Per predictor: its method, its overhead fit, and how many signatures per phase it predicts from shape."""
    for label, p in predictors.items():
        n_shape = {
            ph: len({f.key for k, fs in p.shape_predicted.items() if k.split("/")[0] == ph for f in fs})
            for ph in p.traces
        }
        total = {ph: len(tr.all_unique()) for ph, tr in p.traces.items()}
        shaped = ", ".join(f"{ph} {n_shape.get(ph, 0)} of {total[ph]}" for ph in total)
        err.print(
            f"{label}: predictor {p.method}; overhead fitted on {p.overhead.n_fit} stored forwards; "
            f"signatures predicted from shape alone: {shaped}"
        )


def _print_validation(name: str, rows, predictors, others) -> None:  # type: ignore[no-untyped-def]
    """The table of held-out shapes: measured, each predictor's figure and error, and the share from shape."""
    pred = next(iter(predictors.values()))
    t = Table(title=f"{name}: predicted vs measured forward latency (held-out shapes)")
    cols = ["phase", "shape", "measured ms", "rounds ms"]
    for label in predictors:
        cols += [f"{label} ms", f"{label} err %"]
    cols.append("from shape % (±)")
    for col in cols:
        t.add_column(col, justify="left" if col in ("phase", "shape") else "right")
    for i, r in enumerate(rows):
        cells = [
            r.phase,
            " ".join(f"{k}={v}" for k, v in r.values.items()),
            f"{r.measured_s * 1e3:.2f}",
            " / ".join(f"{x * 1e3:.1f}" for x in r.rounds_s),
        ]
        for label in predictors:
            x = others[label][i]
            cells += [f"{x * 1e3:.2f}", f"{100 * abs(x - r.measured_s) / r.measured_s:.1f}"]
        share, unc = predictors.get("zero new points", pred).shape_share(r.phase, r.values)
        cells.append(f"{100 * share:.0f} (±{100 * unc:.0f})")
        t.add_row(*cells)
    out.print(t)


def _print_mapes(rows, others: dict[str, list[float]], shape: bool) -> None:  # type: ignore[no-untyped-def]
    """One MAPE line per predictor (``others``: its prediction for each row)."""
    from dooly.predict.validate import phase_mape

    for label, preds in others.items():
        scored = [dataclasses.replace(r, predicted_s=x) for r, x in zip(rows, preds, strict=True)]
        what = {
            "profile": "(exact reuse" + (" + shape)" if shape else ")"),
            "shared overhead": "(own points, overhead fitted on the other models: --calibrate none)",
            "zero new points": "(zero new points)",
        }
        out.print(
            f"MAPE prefill {phase_mape(scored, 'prefill'):.1f}%  decode {phase_mape(scored, 'decode'):.1f}%  "
            f"all {phase_mape(scored):.1f}%  {what[label]}"
        )


def _print_spread(rows) -> None:  # type: ignore[no-untyped-def]
    """The rounds' run-to-run spread (the noise floor), and a note when the machine was too busy to trust."""
    from dooly.predict.validate import round_spread

    spread = round_spread(rows)
    out.print(
        f"run-to-run spread of the measurements (noise floor): prefill {round_spread(rows, 'prefill'):.1f}%  "
        f"decode {round_spread(rows, 'decode'):.1f}%  all {spread:.1f}%"
    )
    if spread > NOISY_SPREAD_PCT:
        err.print(
            f"note: the rounds of the same shapes landed {spread:.0f}% apart: something else held the CPU "
            "(another process, or the VM's neighbours), and no MAPE above is meaningful below that; validate "
            "again when the machine is quiet"
        )
