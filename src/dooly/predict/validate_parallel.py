"""Validation of a parallel rank's prediction against the real replica's forwards (``dooly validate --tp``).

The rank's predictor (``Predictor.for_model`` with the engine of ``dooly profile --tp N``: its shards' ops, its
collectives timed between processes, the one-device framework overhead) is scored against forwards of the whole
replica: ``N`` processes, one per core, each vLLM's model for its rank, exchanging through vLLM's shared-memory
all-reduce (:class:`~dooly.profile.parallel_forward.ReplicaRanks`). With pipeline stages (``--pp``) the figure
predicted is the sum of the stages' (one rank's predictor per stage: a lone batch passes through each in turn, as
the simulator's ``PipelineLatency`` prices it), measured on the last stage. The shapes, rounds and rows are those
of :func:`~dooly.predict.validate.validate_model`, so the same MAPE and noise floor read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dooly.core.errors import DoolyError
from dooly.predict.predictor import Predictor
from dooly.predict.validate import VALIDATION_SHAPES, ValidationRow, held_out_medians, held_out_rows


def validate_parallel(
    predictor: Predictor | Sequence[Predictor],
    config: Mapping[str, object],
    engine: Any,
    shapes: Mapping[str, list[dict[str, int]]] | None = None,
    threads: int | None = None,
    repeats: int = 5,
    store: Any | None = None,
    rounds: int = 2,
    on_step: Callable[[int, int, str], None] | None = None,
) -> list[ValidationRow]:
    """As :func:`~dooly.predict.validate.validate_model`, for ``engine`` (vLLM's, with ``tensor_parallel_size`` or
    ``pipeline_parallel_size`` above 1): each held-out shape timed on the real replica (the wall time of the rank
    that ends the step, the ranks lined up before every forward), in ``rounds`` interleaved rounds, each round's
    median kept in ``rounds_s`` (their spread is the noise floor). ``predictor``: the rank's, or with ``pp`` stages
    one per stage, in order (their forwards summed). ``threads``: torch threads per rank (default 1). With a
    ``store`` the measurements are kept (as models ``"<name>#holdout-tpN"``, ``"<name>#holdout2-tpN"``, ...;
    ``-tpNppM`` with stages; never fitted on) and reused by the next call."""
    from dooly.core.zoo import max_positions
    from dooly.db.store import Measurement
    from dooly.profile import context_for, shapes_within
    from dooly.profile.parallel_forward import ReplicaRanks

    tp, pp = int(getattr(engine, "tp", 1)), int(getattr(engine, "pp", 1))
    if getattr(engine, "name", None) != "vllm" or tp * pp < 2:
        raise DoolyError("validation of a parallel replica needs the vllm engine with --tp or --pp of 2 or more")
    stages = list(predictor) if isinstance(predictor, Sequence) else [predictor]
    if len(stages) != pp:
        raise DoolyError(f"a replica of {pp} pipeline stage(s) is predicted by one predictor per stage, "
                         f"not {len(stages)}")  # fmt: skip
    threads = threads or 1
    shapes = shapes_within(shapes or VALIDATION_SHAPES, max_positions(config))
    layout = f"tp{tp}" + (f"pp{pp}" if pp > 1 else "")
    # "#holdout" in the name: the overhead fit and the savings never read them (as validate_model's)
    keys = [f"{stages[0].name}#holdout" + (str(r + 1) if r else "") + f"-{layout}" for r in range(max(1, rounds))]
    ctx = context_for(engine, threads) if store is not None else None
    ranks: ReplicaRanks | None = None

    def measure(phase: str, v: Mapping[str, int], note: Callable[[str], None]) -> Measurement:
        nonlocal ranks
        if ranks is None:
            note(f"starting {tp * pp} ranks")
            ranks = ReplicaRanks(config, tp=tp, dtype=engine.dtype, threads=threads, pp=pp)
        t = ranks.time(phase, v, repeats=repeats)
        return Measurement(t.median_s, t.p10_s, t.p90_s, len(t.wall_s), float(sum(t.wall_s)))

    try:
        medians = held_out_medians(shapes, keys, measure, store, ctx, on_step)
    finally:
        if ranks is not None:
            ranks.close()
    return held_out_rows(shapes, medians, lambda phase, v: sum(p.forward_latency(phase, v) for p in stages))


__all__ = ["validate_parallel"]
