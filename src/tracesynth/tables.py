"""Result rows as text: one cell format, one `mean ± std`, one renderer per markup.

The Markdown results (results.md), the HTML report and the CLI all print through these, so the
same number prints with the same digits everywhere.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

# The fidelity table's columns, in the order the Markdown results and the HTML report show them.
FIDELITY_COLUMNS = (
    "workload",
    "generator",
    "variant",
    "jsd_event",
    "jsd_2gram",
    "jsd_3gram",
    "dt_wasserstein",
    "latency_wasserstein",
    "violation_rate",
    "longest_shared_run",
    "copied_window_share",
)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def cell(v: Any) -> str:
    """One value as table text: floats to 4 significant digits; NaN and None (a NaN after a JSON
    round trip, or a score that does not apply) as n/a."""
    if _missing(v):
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def mean_std(row: Mapping[str, Any], value: str) -> str:
    """'mean ± std' of a summary row's `value` (its spread in `value_std`); n/a where there is no mean."""
    m, sd = row.get(value), row.get(f"{value}_std")
    if _missing(m):
        return "n/a"
    return f"{m:.4g} ± {0.0 if _missing(sd) else sd:.2g}"


def mean_std_rows(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str], values: Sequence[str]
) -> list[dict[str, Any]]:
    """Summary rows (tracesynth.evaluate.experiments.summarise) with each value as 'mean ± std' text,
    followed by the number of measurements `n`."""
    return [{**{k: r.get(k) for k in keys}, **{v: mean_std(r, v) for v in values}, "n": r.get("n")} for r in rows]


def columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every key of the rows, in first-seen order."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols


def markdown_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str] | None = None) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = list(cols or columns(rows))
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def html_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str] | None = None) -> str:
    cols = list(cols or columns(rows))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
