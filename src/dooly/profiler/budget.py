"""What a plan can leave to the shape model: exact reuse, prediction from shape alone, or measurement.

Each signature a plan would profile (new: neither complete in the DB nor needed by an earlier model of the
list) is either **covered** by the shape model fitted on the DB's points (:mod:`dooly.shape_model`: its
operator kind has a model) or not. ``dooly profile --budget N`` measures every uncovered signature and, of
the covered ones, the ``N`` that contribute most uncertainty to the models' forwards: relative prediction
interval x predicted seconds (mean over its grid) x how often the passes run it. The rest are predicted
from shape (``dooly validate --shape``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from dooly.profiler.plan import Plan
from dooly.shape_model import ShapeModel, signatures_of
from dooly.store import ProfileStore


@dataclass
class ShapeTriage:
    """The plan's new signatures sorted three ways, with the uncertainty score of each covered one."""

    reused: set[str]  # complete in the DB before the run (a key new in the list is priced once, as new)
    uncovered: set[str]  # new, and no shape model covers their kind: must be measured
    covered: dict[str, float]  # new and predictable: sig key -> uncertainty score (seconds per forward set)
    rel_uncertainty: dict[str, float] = field(default_factory=dict)  # sig key -> exp(sigma) - 1

    def least_certain(self, budget: int | None) -> list[str]:
        """The ``budget`` covered signatures to measure, least certain first (all of them when None)."""
        ranked = sorted(self.covered, key=lambda k: (-self.covered[k], k))
        return ranked if budget is None else ranked[: max(0, budget)]


def triage(plan: Plan, store: ProfileStore, hidden: Collection[str] = ()) -> ShapeTriage:
    """Sort the plan's signatures by what the shape model fitted on the DB as it is now can predict
    (``hidden``: signatures in the DB treated as never profiled, to replay a budget on a complete profile)."""
    hidden = set(hidden)
    known = plan.known - hidden
    raw = store.all_points(plan.ctx)
    measured = {k: [(p, m.median_s) for p, m in v] for k, v in raw.items() if k in known}
    model = ShapeModel.fit(signatures_of(store, plan.ctx, measured), measured)
    reused: set[str] = set()
    uncovered: set[str] = set()
    covered: dict[str, float] = {}
    rel: dict[str, float] = {}
    for mp in plan.models:
        for phase, needs in mp.needs.items():
            for key, need in needs.items():
                if key in known or key in reused:
                    reused.add(key)
                    continue
                if key in uncovered:
                    continue
                sig = need.signature
                if not model.covers(sig):
                    uncovered.add(key)
                    continue
                pred = model.predict(sig, mp.grid.signature_points(phase, sig.symbols()))
                rel[key] = pred.rel_uncertainty
                # summed over every pass that runs it: what an error in it costs the forwards it is part of
                covered[key] = covered.get(key, 0.0) + rel[key] * float(pred.seconds.mean()) * need.multiplicity
    return ShapeTriage(reused, uncovered, covered, rel)
