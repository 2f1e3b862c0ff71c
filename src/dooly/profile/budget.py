"""What a plan can leave to the shape model: exact reuse, prediction from shape alone, or measurement.

Each signature a plan would profile (new: neither complete in the DB nor needed by an earlier model of the
list) is either **covered** by the shape model fitted on the DB's points (:mod:`dooly.db.shape_model`: its
operator kind has a model) or not. ``dooly profile --budget N`` measures every uncovered signature and, of
the covered ones, the ``N`` that contribute most uncertainty to the models' forwards: relative prediction
interval x predicted seconds (mean over its grid) x how often the passes run it. The rest are predicted
from shape (``dooly validate --shape``). ``--budget-seconds S`` caps device time instead of a count: the
uncovered signatures are measured first, then covered ones in the same order while their predicted
profiling cost (the shape model's latency at each planned point, priced by
:class:`~dooly.profile.savings.PointCost`) still fits in S.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from dooly.db.shape_model import ShapeModel, signatures_of
from dooly.db.store import ProfileStore
from dooly.profile.plan import Plan
from dooly.profile.savings import PointCost


@dataclass
class ShapeTriage:
    """The plan's new signatures sorted three ways, with the uncertainty score of each covered one."""

    reused: set[str]  # complete in the DB before the run (a key new in the list is priced once, as new)
    uncovered: set[str]  # new, and no shape model covers their kind: must be measured
    covered: dict[str, float]  # new and predictable: sig key -> uncertainty score (seconds per forward set)
    rel_uncertainty: dict[str, float] = field(default_factory=dict)  # sig key -> exp(sigma) - 1
    # predicted device seconds to profile each new signature on its planned points (covered: the shape model's
    # latency priced per point; uncovered: the DB's mean cost per point)
    cost_s: dict[str, float] = field(default_factory=dict)

    def least_certain(self, budget: int | None) -> list[str]:
        """The ``budget`` covered signatures to measure, least certain first (all of them when None)."""
        ranked = sorted(self.covered, key=lambda k: (-self.covered[k], k))
        return ranked if budget is None else ranked[: max(0, budget)]

    @property
    def uncovered_s(self) -> float:
        """Predicted device seconds of the signatures that must be measured whatever the budget."""
        return sum(self.cost_s.get(k, 0.0) for k in self.uncovered)

    def within_seconds(self, seconds: float) -> list[str]:
        """The covered signatures to measure within ``seconds`` of predicted profiling time, least certain
        first, after the uncovered ones (which spend the budget first): one that no longer fits is skipped
        and a cheaper one after it may still fit."""
        left = seconds - self.uncovered_s
        out = []
        for key in self.least_certain(None):
            cost = self.cost_s.get(key, 0.0)
            if cost <= left:
                out.append(key)
                left -= cost
        return out


def triage(plan: Plan, store: ProfileStore, hidden: Collection[str] = ()) -> ShapeTriage:
    """Sort the plan's signatures by what the shape model fitted on the DB as it is now can predict
    (``hidden``: signatures in the DB treated as never profiled, to replay a budget on a complete profile)."""
    hidden = set(hidden)
    known = plan.known - hidden
    raw = store.all_points(plan.ctx)
    measured = {k: [(p, m.median_s) for p, m in v] for k, v in raw.items() if k in known}
    model = ShapeModel.fit(signatures_of(store, plan.ctx, measured), measured)
    flat = [m for k, v in raw.items() if k in known for _, m in v]
    price = PointCost.fit([m.median_s for m in flat], [m.cost_s for m in flat])
    per_point = sum(m.cost_s for m in flat) / len(flat) if flat else 0.05  # as savings_of prices the unmodelled
    cost: dict[str, float] = {}
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
                    cost[key] = plan.grid_size.get(key, 1) * per_point
                    continue
                pred = model.predict(sig, mp.grid.signature_points(phase, sig.symbols()))
                rel[key] = pred.rel_uncertainty
                cost.setdefault(key, float(price(pred.seconds).sum()))  # on the grid of the first model needing it
                # summed over every pass that runs it: what an error in it costs the forwards it is part of
                covered[key] = covered.get(key, 0.0) + rel[key] * float(pred.seconds.mean()) * need.multiplicity
    return ShapeTriage(reused, uncovered, covered, rel, cost)
