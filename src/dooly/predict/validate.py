"""Validation against real forwards: time the whole model at held-out shapes and score the predictor on them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dooly.core import stats
from dooly.predict.predictor import Predictor

#: Held-out shapes: on neither the profiling grid nor the calibration shapes.
VALIDATION_SHAPES: dict[str, list[dict[str, int]]] = {
    "prefill": [
        {"requests": 1, "tokens": 24},
        {"requests": 1, "tokens": 48},
        {"requests": 1, "tokens": 96},
        {"requests": 1, "tokens": 200},
        {"requests": 3, "tokens": 40},
    ],
    "decode": [
        {"requests": 1, "kv_len": 40},
        {"requests": 3, "kv_len": 100},
        {"requests": 6, "kv_len": 300},
        {"requests": 12, "kv_len": 700},
        {"requests": 24, "kv_len": 150},
    ],
}


@dataclass
class ValidationRow:
    phase: str
    values: dict[str, int]
    measured_s: float  # median over the rounds' medians
    predicted_s: float
    rounds_s: tuple[float, ...] = ()  # each round's median, rounds taken minutes apart

    @property
    def error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s

    @property
    def spread(self) -> float:
        """How far this shape's rounds landed apart, relative to their mean (0 with one round)."""
        if len(self.rounds_s) < 2:
            return 0.0
        return stats.spread_pct(np.array(self.rounds_s)[:, None]) / 100


def validate_model(
    predictor: Predictor,
    config: Mapping[str, object],
    engine: object,
    shapes: Mapping[str, list[dict[str, int]]] | None = None,
    threads: int | None = None,
    repeats: int = 5,
    store: object | None = None,
    rounds: int = 2,
    on_step: Callable[[int, int, str], None] | None = None,
) -> list[ValidationRow]:
    """Measure real forwards at held-out shapes and pair them with the predictor's figures.

    Every shape is measured in ``rounds`` interleaved rounds (all shapes, then all again), so a slow drift of
    the machine shows as each row's ``spread``: a prediction cannot be expected to agree with a measurement
    better than two measurements of the same pass agree with each other (:func:`round_spread`).
    With a ``store`` the measurements are kept (as models ``"<name>#holdout"``, ``"<name>#holdout2"``, ...,
    which the overhead fit never reads) and reused by the next call, so predictor changes can be re-scored
    without re-measuring. ``on_step(done, total, what)`` follows the forwards (progress for the CLI).
    """
    import torch

    from dooly.core.zoo import max_positions
    from dooly.profile import context_for, default_clock, fixed_threads, measure_forward, shapes_within

    shapes = shapes_within(shapes or VALIDATION_SHAPES, max_positions(config))
    clock = default_clock(engine.device, threads)  # type: ignore[attr-defined]
    keys = [f"{predictor.name}#holdout" + (str(r + 1) if r else "") for r in range(max(1, rounds))]
    ctx = context_for(engine, threads) if store is not None else None  # type: ignore[arg-type]
    model = None

    def measure(phase: str, v: Mapping[str, int], note: Callable[[str], None]) -> object:
        nonlocal model
        if model is None:
            torch.manual_seed(0)
            model = engine.build_model(config)  # type: ignore[attr-defined]
        return measure_forward(engine, model, phase, v, repeats=repeats, clock=clock)  # type: ignore[arg-type]

    with fixed_threads(threads):
        medians = held_out_medians(shapes, keys, measure, store, ctx, on_step)
    return held_out_rows(shapes, medians, predictor.forward_latency)


def held_out_medians(
    shapes: Mapping[str, list[dict[str, int]]],
    keys: Sequence[str],
    measure: Callable[[str, Mapping[str, int], Callable[[str], None]], Any],
    store: Any | None,
    ctx: Any,
    on_step: Callable[[int, int, str], None] | None,
) -> dict[tuple[str, str], list[float]]:
    """Each round's median at every held-out shape: rounds interleaved (every shape under ``keys[0]``, then all
    again under ``keys[1]``, ...), each read back from ``store`` where kept, else ``measure(phase, values, note)``
    (a Measurement; ``note(what)`` reports set-up at this step) and stored under its round's key."""
    from dooly.db.store import canonical_point

    have: dict[tuple[str, str, str], Any] = {}
    if store is not None:
        for key in keys:
            for _, ph, v, m in store.forwards(ctx, key):
                have[(key, ph, canonical_point(v))] = m
    medians: dict[tuple[str, str], list[float]] = {}
    step, done, total = on_step or (lambda d, t, w: None), 0, len(keys) * sum(len(vs) for vs in shapes.values())
    for key in keys:
        for phase, vs in shapes.items():
            for v in vs:
                step(done, total, f"{phase} " + " ".join(f"{k}={x}" for k, x in v.items()))
                m = have.get((key, phase, canonical_point(v)))
                if m is None:
                    m = measure(phase, v, lambda what, at=done: step(at, total, what))
                    if store is not None:
                        store.put_forward(ctx, key, phase, v, m)
                done += 1
                medians.setdefault((phase, canonical_point(v)), []).append(m.median_s)
    step(total, total, "done")
    return medians


def held_out_rows(
    shapes: Mapping[str, list[dict[str, int]]],
    medians: Mapping[tuple[str, str], Sequence[float]],
    predict: Callable[[str, Mapping[str, int]], float],
) -> list[ValidationRow]:
    """A row per held-out shape: the median of its rounds' medians, beside ``predict(phase, values)``."""
    from dooly.db.store import canonical_point

    rows = []
    for phase, vs in shapes.items():
        for v in vs:
            rs = tuple(medians[(phase, canonical_point(v))])
            rows.append(ValidationRow(phase, dict(v), float(np.median(rs)), predict(phase, v), rs))
    return rows


def phase_mape(rows: Sequence[ValidationRow], phase: str | None = None) -> float:
    """Forward-latency MAPE (%) of the predictor over the validation rows of one phase (all when None)."""
    sel = [r for r in rows if phase is None or r.phase == phase]
    return stats.mape([r.predicted_s for r in sel], [r.measured_s for r in sel])


def round_spread(rows: Sequence[ValidationRow], phase: str | None = None) -> float:
    """Mean spread (%) between the measurement rounds of the same shapes: the machine's noise floor."""
    sel = [r.spread for r in rows if (phase is None or r.phase == phase) and len(r.rounds_s) > 1]
    return float(np.mean(sel)) * 100 if sel else float("nan")
