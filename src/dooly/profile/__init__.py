"""Redundancy-aware profiler: time each unique operator signature once, over a grid of request values.

The plan (:mod:`~dooly.profile.plan`) is a list of independent jobs, one per forward context, for the
signatures not yet complete in the profile DB; a job (:mod:`~dooly.profile.runner`) materialises inputs of
the signature's concrete shapes, warms up, times the operator with the device's clock
(:mod:`~dooly.profile.timing`) and commits every finished point to the :class:`~dooly.db.store.ProfileStore`
at once, so a killed run resumes where it stopped. :func:`~dooly.profile.run.run_plan` runs the jobs
in-process by default, or on a Ray cluster (:mod:`~dooly.profile.cluster`). Real forwards of the whole model
calibrate the framework overhead (:mod:`~dooly.profile.calibrate`); :mod:`~dooly.profile.savings` prices what
reuse saved.
"""

from dooly.profile.calibrate import CALIBRATION_ROUNDS, CALIBRATION_SHAPES, calibrate
from dooly.profile.plan import GridSpec, Job, ModelPlan, Plan, make_plan, shapes_within
from dooly.profile.run import run_plan
from dooly.profile.runner import JobRunner
from dooly.profile.savings import ModelCost, Savings, profiled_savings, savings
from dooly.profile.timing import (
    TimerConfig,
    clock_of,
    context_for,
    default_clock,
    default_threads,
    evict_caches,
    fixed_threads,
    measure_forward,
    measure_prepared,
    time_calls,
)
from dooly.profile.traces import PHASE_SYMBOLS, model_traces, trace_cache_key, tracer_version

__all__ = [
    "CALIBRATION_ROUNDS",
    "CALIBRATION_SHAPES",
    "PHASE_SYMBOLS",
    "GridSpec",
    "Job",
    "JobRunner",
    "ModelCost",
    "ModelPlan",
    "Plan",
    "Savings",
    "TimerConfig",
    "calibrate",
    "clock_of",
    "context_for",
    "default_clock",
    "default_threads",
    "evict_caches",
    "fixed_threads",
    "make_plan",
    "measure_forward",
    "measure_prepared",
    "model_traces",
    "profiled_savings",
    "run_plan",
    "savings",
    "shapes_within",
    "time_calls",
    "trace_cache_key",
    "tracer_version",
]
