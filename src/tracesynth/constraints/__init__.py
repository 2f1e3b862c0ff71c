"""Constraints mined from real traces: a readable Rules document (kernel invariants, always
enforced, and learned rules calibrated across time blocks of the training data, each held out in
turn: enforced where they hold in every block that exercised them, advisory otherwise), a
vectorised checker (advisory entries reported apart, never counted) and a repairer that fixes
each violation with the smallest edit the rules allow.

    rules = mine_rules([trace, ...]); rules.save("rules.json")
    report = check_trace(synthetic, rules); report.rate, report.to_dict()
    fixed, how = repair_trace(synthetic, rules, seed=0)   # check_trace(fixed, rules).total == 0
"""

from tracesynth.constraints.check import RULES, CheckReport, check_trace
from tracesynth.constraints.mine import DEFAULT_PARAMS, mine_rules
from tracesynth.constraints.repair import RepairReport, repair_trace
from tracesynth.constraints.rules import Rules

__all__ = [
    "DEFAULT_PARAMS",
    "RULES",
    "CheckReport",
    "RepairReport",
    "Rules",
    "check_trace",
    "mine_rules",
    "repair_trace",
]
