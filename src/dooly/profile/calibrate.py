"""Calibration: real forwards of the full model, from which the predictor fits the framework overhead.

The model also runs at half its depth. Within one model every pass holds the same operator calls, so the
forwards alone cannot tell a fixed cost per pass from a cost per operator call; at two depths they can, and a
model built from the same layers at another depth is then predicted from the slope, not from a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dooly.core.zoo import at_depth, max_positions, num_layers
from dooly.db.store import ProfileContext, ProfileStore, canonical_point
from dooly.engines import Engine
from dooly.profile.plan import shapes_within
from dooly.profile.timing import clock_of, fixed_threads, measure_forward
from dooly.profile.traces import model_traces
from dooly.trace.signature import canonical_json

#: Shapes whose real forwards calibrate the framework overhead; off the grid and off the validation shapes.
CALIBRATION_SHAPES: dict[str, list[dict[str, int]]] = {
    "prefill": [
        {"requests": 1, "tokens": 12},
        {"requests": 1, "tokens": 64},
        {"requests": 1, "tokens": 160},
        {"requests": 2, "tokens": 72},
    ],
    "decode": [
        {"requests": 1, "kv_len": 200},
        {"requests": 2, "kv_len": 30},
        {"requests": 4, "kv_len": 60},
        {"requests": 8, "kv_len": 500},
        {"requests": 20, "kv_len": 80},
    ],
}
CALIBRATION_ROUNDS = 2  # every shape measured in interleaved rounds, so one slow minute does not skew the fit
#: ``--calibrate check``: one shape per phase (the overhead is fitted per phase), from the calibration set
CHECK_SHAPES: dict[str, list[dict[str, int]]] = {
    "prefill": [{"requests": 1, "tokens": 64}],
    "decode": [{"requests": 4, "kv_len": 60}],
}
#: the forwards of a check are stored as ``NAME#check``: the overhead fit has no config under that key, so it
#: never reads them (a model fitted on two forwards of its own would be worse off than with the shared fit)
CHECK_SUFFIX = "#check"
CALIBRATION_POLICIES = ("all", "check", "none")
#: what a ``--calibrate check`` that missed measures: the calibration shapes at the model's own depth, one round
#: (the check's two forwards among them). Its own overhead is then fitted on those: enough to price the model
#: itself, whose forwards all hold its operator calls; the half depth and the second round serve the shared fit,
#: which the fully calibrated models already give. About a third of a full calibration's cost.
LIGHT_ROUNDS = 1
#: a checked forward passes when the shared fit predicts it within this (plus the stated uncertainty of the
#: share of the pass predicted from shape): the issue's bound is 3 points of forward MAPE over calibrating
#: every model, and a single forward's noise on a quiet CPU is 1-5%
CHECK_TOLERANCE = 0.05


def phase_points(shapes: Mapping[str, list[dict[str, int]]]) -> set[tuple[str, str]]:
    """``shapes`` ({phase: [values]}) as the (phase, canonical point) pairs the DB keys forwards by."""
    return {(ph, canonical_point(v)) for ph, vs in shapes.items() for v in vs}


#: ``NAME@tpN``: the calibration forwards of a tensor-parallel replica of NAME (:func:`calibrate_replica`); they fit
#: its ranks' overhead alone, never a one-device model's
REPLICA_MARK = "@"


def replica_key(name: str, engine: Engine) -> str | None:
    """Where ``engine``'s replica of ``name`` keeps its calibration forwards (``NAME@tpN``); None on one device and
    with pipeline stages (a stage's rank keeps the one-device overhead)."""
    tp, pp = int(getattr(engine, "tp", 1)), int(getattr(engine, "pp", 1))
    return f"{name}{REPLICA_MARK}tp{tp}" if tp > 1 and pp == 1 else None


def calibrated_models(store: ProfileStore, ctx: ProfileContext) -> set[str]:
    """Models with a full calibration under ``ctx`` on one device (a check, validation's held-out forwards or a
    replica's forwards are none)."""
    keys = {k for k, *_ in store.forwards(ctx)}
    skip = ("#holdout", CHECK_SUFFIX)
    names = {k.split("#")[0] for k in keys if not k.startswith("#") and not any(s in k for s in skip)}
    return {n for n in names if REPLICA_MARK not in n}


def calibration_needs(
    store: ProfileStore, ctx: ProfileContext, models: Mapping[str, Mapping[str, Any]], policy: str
) -> dict[str, str]:
    """What calibration each of ``models`` ({name: config}, in profiling order) will take under ``policy``,
    and why: one line per model, for ``dooly plan``."""
    done = calibrated_models(store, ctx)
    shared = len(done)
    out = {}
    for name, cfg in models.items():
        depths = len(calibration_variants(name, cfg))
        full = f"{full_calibration_forwards(cfg)} forwards ({depths} depth(s) x {CALIBRATION_ROUNDS} rounds)"
        if name in done:
            out[name] = "none to run: already calibrated in the DB"
        elif policy == "none" and shared:
            out[name] = f"none (--calibrate none): its overhead from the shared fit of {shared} model(s)"
        elif policy == "none":
            out[name] = "none (--calibrate none), and no model to share an overhead fit: no framework overhead"
        elif policy == "all" or not shared:
            why = "--calibrate all" if policy == "all" else "no shared overhead fit on this engine and hardware yet"
            out[name] = f"full, {full}: {why}"
            shared += 1
        else:
            k = sum(len(v) for v in CHECK_SHAPES.values())
            light = full_calibration_forwards(cfg, light=True)
            miss = (
                f"if one misses by more than {100 * CHECK_TOLERANCE:.0f}% (+ shape uncertainty), {light} forwards at "
                "its own depth, one round"
            )
            out[name] = f"check: {k} forwards against the shared overhead fit of {shared} model(s); {miss}"
    return out


def calibration_variants(name: str, config: Mapping[str, Any], stages: int = 1) -> dict[str, dict[str, Any]]:
    """The model and, when half its depth still gives each of its ``stages`` pipeline stages a layer, the model
    at half its depth (``NAME#layersK``)."""
    variants = {name: dict(config)}
    depth = num_layers(config) or 0
    if depth >= 2 * stages:
        variants[f"{name}#layers{depth // 2}"] = at_depth(config, depth // 2)
    return variants


def full_calibration_forwards(config: Mapping[str, Any], light: bool = False) -> int:
    """How many forwards a full calibration of a model with ``config`` measures (``light``: the one a missed check
    takes, see :data:`LIGHT_ROUNDS`)."""
    shapes = sum(len(v) for v in shapes_within(CALIBRATION_SHAPES, max_positions(config)).values())
    if light:
        return LIGHT_ROUNDS * shapes
    return CALIBRATION_ROUNDS * len(calibration_variants("m", config)) * shapes


def check_forwards(
    name: str,
    config: Mapping[str, Any],
    store: ProfileStore,
    engine: Engine,
    ctx: ProfileContext,
    threads: int | None = None,
    repeats: int = 5,
) -> dict[tuple[str, str], float]:
    """Measure (or read back) the model's forwards at :data:`CHECK_SHAPES`, stored as ``NAME#check``;
    returns ``{(phase, canonical point): median seconds}``."""
    import torch

    key, out = name + CHECK_SUFFIX, {}
    have = {(ph, canonical_point(v)): m.median_s for _, ph, v, m in store.forwards(ctx, key)}
    model = None
    with fixed_threads(threads):
        for ph, vs in shapes_within(CHECK_SHAPES, max_positions(config)).items():
            for v in vs:
                got = have.get((ph, canonical_point(v)))
                if got is None:
                    if model is None:
                        torch.manual_seed(0)
                        model = engine.build_model(dict(config))
                    m = measure_forward(engine, model, ph, v, repeats=repeats, clock=clock_of(ctx))
                    store.put_forward(ctx, key, ph, v, m)
                    got = m.median_s
                out[(ph, canonical_point(v))] = got
    return out


def calibrate(
    name: str,
    config: Mapping[str, Any],
    store: ProfileStore,
    engine: Engine,
    ctx: ProfileContext,
    shapes: Mapping[str, list[dict[str, int]]] | None = None,
    threads: int | None = None,
    repeats: int = 5,
    on_step: Callable[[int, int, str], None] | None = None,
    light: bool = False,
) -> float:
    """Measure and store real forwards of the model, and of it at half depth (as ``NAME#layersK``, with its
    config), at the calibration shapes; returns seconds spent. ``on_step(done, total, what)`` is called before the
    first forward, as each model is built and after each shape is measured (minutes on a large model). ``light``:
    its own depth only, :data:`LIGHT_ROUNDS` round(s), the shapes its check measured taken as measured."""
    import torch

    shapes = shapes_within(shapes or CALIBRATION_SHAPES, max_positions(config))
    if light:
        variants, rounds = {name: dict(config)}, LIGHT_ROUNDS
    else:
        variants, rounds = calibration_variants(name, config, stages=getattr(engine, "pp", 1)), CALIBRATION_ROUNDS
    todo = _calibration_todo(variants, shapes, store, engine, ctx, rounds)
    if light:  # its check's forwards are its first round's at their shapes (the overhead fit reads them)
        checked = {(ph, canonical_point(v)) for _, ph, v, _ in store.forwards(ctx, name + CHECK_SUFFIX)}
        todo = [t for t in todo if t[1] != name or (t[2], canonical_point(t[3])) not in checked]
    if not todo:
        return 0.0
    spent, model, built = 0.0, None, None
    step = on_step or (lambda done, total, what: None)
    with fixed_threads(threads):
        for i, (variant, key, ph, v) in enumerate(todo):
            if variant != built:  # one model in memory at a time (a large model and its half would not fit)
                model = None
                step(i, len(todo), f"building {variant}")
                torch.manual_seed(0)
                model, built = engine.build_model(variants[variant]), variant
            m = measure_forward(engine, model, ph, v, repeats=repeats, clock=clock_of(ctx))
            store.put_forward(ctx, key, ph, v, m)
            spent += m.cost_s
            step(i + 1, len(todo), f"{variant} {ph} " + " ".join(f"{k}={x}" for k, x in v.items()))
    del model
    return spent


def calibrate_replica(
    name: str,
    config: Mapping[str, Any],
    store: ProfileStore,
    engine: Engine,
    ctx: ProfileContext,
    threads: int | None = None,
    repeats: int = 5,
    on_step: Callable[[int, int, str], None] | None = None,
) -> float:
    """Real forwards of the ``engine.tp``-way tensor-parallel replica (a process per rank, vLLM's shared-memory
    all-reduce between them), at its depth and half of it, at the calibration shapes, timed on the wall clock as
    ``dooly validate --tp`` times the replica; stored as ``NAME@tpN`` with each depth's config and rank traces, from
    which the rank's overhead is fitted. Returns device seconds (wall seconds x ranks)."""
    from dooly.db.store import Measurement
    from dooly.profile.parallel_forward import ReplicaRanks

    key = replica_key(name, engine)
    if key is None:
        raise ValueError(f"calibrate_replica: {engine!r} is not a tensor-parallel rank")
    shapes = shapes_within(CALIBRATION_SHAPES, max_positions(config))
    variants = {key + v[len(name) :]: cfg for v, cfg in calibration_variants(name, config).items()}
    todo = _calibration_todo(variants, shapes, store, engine, ctx, CALIBRATION_ROUNDS)
    tp, dtype = engine.tp, engine.dtype  # type: ignore[attr-defined]
    spent, ranks, built = 0.0, None, None
    step = on_step or (lambda done, total, what: None)
    try:
        for i, (variant, round_key, ph, v) in enumerate(todo):
            if variant != built:  # one replica at a time
                if ranks is not None:
                    ranks.close()
                step(i, len(todo), f"starting the {tp} ranks of {variant}")
                ranks, built = ReplicaRanks(variants[variant], tp=tp, dtype=dtype, threads=threads or 1), variant
            t = ranks.time(ph, v, repeats=repeats)
            cost = float(sum(t.wall_s)) * tp
            store.put_forward(ctx, round_key, ph, v, Measurement(t.median_s, t.p10_s, t.p90_s, len(t.wall_s), cost))
            spent += cost
            step(i + 1, len(todo), f"{variant} {ph} " + " ".join(f"{k}={x}" for k, x in v.items()))
    finally:
        if ranks is not None:
            ranks.close()
    return spent


def _calibration_todo(
    variants: Mapping[str, Mapping[str, Any]],
    shapes: Mapping[str, list[dict[str, int]]],
    store: ProfileStore,
    engine: Engine,
    ctx: ProfileContext,
    rounds: int,
) -> list[tuple[str, str, str, dict[str, int]]]:
    """The forwards ``rounds`` of calibration of ``variants`` ({key: config}) still lack: (variant, round's key,
    phase, values), after storing each variant's config and traces."""
    for variant, cfg in variants.items():
        store.put_trace("config", variant, "config", canonical_json(cfg))
        # traced here, where the store is writable: the overhead fit reads every variant's trace, and commands
        # that only read the DB would trace it again on every load
        model_traces(variant, cfg, engine, store)
    todo = []
    for k in range(rounds):
        # both depths in each round, in turn (ABBA: a steady drift of the machine weighs on both alike)
        for variant in list(variants)[:: 1 if k % 2 == 0 else -1]:
            key = variant if k == 0 else f"{variant}#round{k + 1}"  # the fit reads every round as its own rows
            have = {(ph, canonical_point(v)) for _, ph, v, _ in store.forwards(ctx, key)}
            todo += [
                (variant, key, ph, v) for ph, vs in shapes.items() for v in vs if (ph, canonical_point(v)) not in have
            ]
    return todo
