"""`dooly report`: one self-contained HTML page from a profile DB and the serving results beside it.

Sections: onboarding savings per model (cross-model reuse vs onboarding each model alone: tracing, operator
profiling and calibration forwards, over the models profiled into the DB, priced as ``dooly profile`` prices
them), predicted vs measured forward latency (where the DB holds measured forwards and a predictor), simulated
vs measured serving latency CDFs and the validation table (from the JSON results ``dooly validate-serving``
writes), and any configuration sweep.
Plots are matplotlib PNGs embedded as base64, so the page is one file that opens anywhere.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from atomicio import atomic_path
from dooly.core.errors import DoolyError

if TYPE_CHECKING:
    from dooly.db.store import ProfileContext
    from dooly.profile import Savings


def results_dir_for(db: str | Path) -> Path:
    """Where serving results of a profile DB live: ``profiles.db`` -> ``profiles.results/``."""
    db = Path(db)
    return db.with_name(db.stem + ".results")


def save_result(db: str | Path, name: str, payload: dict[str, Any]) -> Path:
    """Write one JSON result (validation or sweep) beside the DB, atomically."""
    d = results_dir_for(db)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1, default=_jsonable))
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return [None if not np.isfinite(v) else float(v) for v in x.astype(float)]
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


def write_sweep_csv(points, path: str | Path) -> Path:
    path = Path(path)
    rows = []
    for p in points:
        row = {
            "max_num_seqs": p.config.max_num_seqs,
            "max_num_batched_tokens": p.config.max_num_batched_tokens,
            "chunked_prefill": p.config.chunked_prefill,
            "num_kv_blocks": p.config.num_kv_blocks,
            "meets_slo": p.meets_slo,
            "note": p.reason,
        }
        if p.summary is not None:
            row.update(p.summary.row())
        rows.append(row)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_path(path) as tmp, tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return path


# -- savings --------------------------------------------------------------------------------------------


def savings_from_db(db: str | Path) -> list[tuple[ProfileContext, Savings]]:
    """Savings over the models profiled into the DB, per profile context: the computation ``dooly profile``
    prints (:mod:`dooly.profile.savings`), over every model profiled there, each once."""
    from dooly.db.store import ProfileStore
    from dooly.profile import profiled_savings

    with ProfileStore(db, readonly=True) as store:
        return list(profiled_savings(store).items())


#: the report's savings columns: each model's onboarding split (tracing, operator profiling, calibration
#: forwards), alone and with reuse, then the totals
_SPLIT = ("trace_s", "profile_alone_s", "profile_s", "calib_alone_s", "calib_s", "alone_s", "with_reuse_s")


def _savings_rows(sv: Savings) -> list[dict[str, Any]]:
    rows = []
    for r in sv.models:
        costs = (r.trace_s, r.profile_alone_s, r.profile_s, r.calib_alone_s, r.calib_s, r.alone_s, r.marginal_s)
        split = dict(zip(_SPLIT, costs, strict=True))
        rows.append({"model": r.name, "signatures": r.signatures, "new": r.new, **split})
    return rows


# -- plots ----------------------------------------------------------------------------------------------


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _fig(w: float = 6.0, h: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(w, h))


def _savings_plot(rows: list[dict[str, Any]]) -> str:
    fig, ax = _fig(max(6.0, 0.6 * len(rows)))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["alone_s"] for r in rows], 0.4, label="profiled alone")
    ax.bar(x + 0.2, [r["with_reuse_s"] for r in rows], 0.4, label="with cross-model reuse")
    ax.set_xticks(x, [r["model"] for r in rows], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("onboarding cost: trace + profile + calibrate (s)")
    ax.legend()
    return _png(fig)


def _cdf_plot(result: dict[str, Any], metric: str) -> str:
    fig, ax = _fig(5.0, 3.2)
    for label in ("measured", "simulated"):
        vals = np.array([v for v in result[label][metric] if v is not None], dtype=float) * 1e3
        if len(vals):
            xs = np.sort(vals)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("CDF")
    ax.set_title(f"{result['model']}: {metric.upper()}")
    ax.legend()
    return _png(fig)


def _iteration_plot(result: dict[str, Any]) -> str:
    fig, ax = _fig(4.2, 3.6)
    m = np.array(result["iterations"]["measured"], dtype=float) * 1e3
    p = np.array(result["iterations"]["predicted"], dtype=float) * 1e3
    ax.scatter(m, p, s=8, alpha=0.6)
    hi = float(max(m.max(), p.max())) * 1.05 if len(m) else 1.0
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set_xlabel("measured iteration (ms)")
    ax.set_ylabel("predicted iteration (ms)")
    ax.set_title(f"{result['model']}: per-iteration latency")
    return _png(fig)


# -- page -----------------------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], fmt: dict[str, str] | None = None) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    fmt = fmt or {}
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)

    def cell(c: str, v: Any) -> str:
        if isinstance(v, float):
            if not math.isfinite(v):
                return "-"
            return format(v, fmt.get(c, ".3g"))
        return html.escape(str(v))

    body = "".join("<tr>" + "".join(f"<td>{cell(c, r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}img{margin:4px}h2{border-bottom:1px solid #ddd;margin-top:2em}"""


def build_report(db: str | Path, results: str | Path | None = None) -> str:
    """The HTML page (a string) for profile DB `db` and its results directory."""
    db = Path(db)
    if not db.exists():
        raise DoolyError(f"{db}: no such profile database")
    results = Path(results) if results else results_dir_for(db)
    parts = [f"<html><head><meta charset='utf-8'><title>dooly report</title><style>{CSS}</style></head><body>"]
    parts.append(f"<h1>dooly report</h1><p>profile database <code>{html.escape(str(db))}</code></p>")
    parts += _savings_section(db)
    loaded = _load_results(results)
    parts += _validation_section([r for r in loaded if r.get("kind") == "validation"])
    parts += _simulation_section([r for r in loaded if r.get("kind") == "simulation"])
    parts.append("</body></html>")
    return "\n".join(parts)


def _savings_section(db: Path) -> list[str]:
    """Onboarding cost and cross-model reuse, per profiling context of the DB."""
    parts = ["<h2>Onboarding cost and cross-model reuse</h2>"]
    for ctx, sv in savings_from_db(db):
        rows = _savings_rows(sv)
        parts.append(
            f"<p><code>{html.escape(' / '.join(ctx.as_tuple()))}</code>: {html.escape(sv.describe())} "
            "(the Dooly paper reports 56.4% over 12 models on GPUs).</p>"
        )
        parts.append(_table(rows, dict.fromkeys(_SPLIT, ".2f")))
        parts.append(f"<img src='{_savings_plot(rows)}'>")
    if len(parts) == 1:
        parts.append(
            "<p><em>no models recorded as profiled in this database (a DB from before the record: "
            "rerunning <code>dooly profile</code> on its models records them without timing)</em></p>"
        )
    return parts


def _load_results(results: Path) -> list[dict[str, Any]]:
    """Every result file (``*.json``) of the results directory, in name order (none when it does not exist)."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    loaded = []
    for f in files:
        try:
            loaded.append(json.loads(f.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DoolyError(f"{f}: not a dooly result file") from None
    return loaded


def _validation_rows(vals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per validation and metric (with the runs' spread on it), and one for the iteration MAPE."""
    table = []
    for r in vals:
        noise = r.get("run_to_run_pct") or {}
        for row in r["table"]:
            key = str(row["metric"]).lower()
            spread, q_spread = noise.get(key, float("nan")), noise.get(f"{key}_quantiles", float("nan"))
            table.append(
                {
                    "model": r["model"],
                    "workload": r["workload"],
                    **row,
                    "run_to_run_pct": spread,
                    "quantile_run_to_run_pct": q_spread,
                }
            )
        table.append(
            {"model": r["model"], "workload": r["workload"], "metric": "iteration", "mape_pct": r["iteration_mape"]}
        )
    return table


def _validation_section(vals: list[dict[str, Any]]) -> list[str]:
    """Serving validations: simulated vs measured, a table over all of them and each one's plots."""
    parts = ["<h2>Serving validation: simulated vs measured (real engine on this machine)</h2>"]
    if not vals:
        parts.append("<p><em>no validation results (run <code>dooly validate-serving</code>)</em></p>")
        return parts
    fmt = {k: ".4f" for k in ("measured_p50", "simulated_p50", "measured_mean", "simulated_mean")}
    pct = {k: ".1f" for k in ("mape_pct", "quantile_err_pct", "run_to_run_pct", "quantile_run_to_run_pct")}
    parts.append(_table(_validation_rows(vals), fmt | pct))
    parts.append(
        "<p>Times in seconds. MAPE is per request (TTFT, TPOT) or per iteration (predictor vs the "
        "measured latency of the iterations that actually ran), against each request's median over the "
        "real runs; run_to_run_pct is how far those real runs land apart (the noise floor: a "
        "prediction cannot agree with a run better than the runs agree). quantile_err_pct compares "
        "the distributions instead (error at p10, p25, p50, p75 and p90, averaged), with its own "
        "floor quantile_run_to_run_pct.</p>"
    )
    for r in vals:
        parts.append(
            f"<div><img src='{_cdf_plot(r, 'ttft')}'><img src='{_cdf_plot(r, 'tpot')}'>"
            f"<img src='{_iteration_plot(r)}'></div>"
        )
    return parts


def _simulation_section(sims: list[dict[str, Any]]) -> list[str]:
    """Simulated serving results: each one's summary, its sweep and its latency CDFs (no section without any)."""
    parts = ["<h2>Simulated serving</h2>"] if sims else []
    for r in sims:
        parts.append(f"<h3>{html.escape(r['model'])}: {html.escape(r['workload'])}</h3>")
        parts.append(_table([r["summary"]], {}))
        if r.get("sweep"):
            parts.append(
                f"<p>sweep under {html.escape(r.get('slo', ''))}; best: <b>{html.escape(str(r.get('best')))}</b></p>"
            )
            parts.append(_table(r["sweep"]))
        if r.get("e2e"):
            parts.append(f"<img src='{_latency_cdf_plot(r)}'>")
    return parts


def _latency_cdf_plot(result: dict[str, Any]) -> str:
    fig, ax = _fig(5.0, 3.2)
    for metric in ("ttft", "e2e"):
        xs = np.sort(np.array([v for v in result[metric] if v is not None], dtype=float) * 1e3)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=metric.upper())
    ax.set_xlabel("ms")
    ax.set_ylabel("CDF")
    ax.legend()
    return _png(fig)


def write_report(db: str | Path, output: str | Path, results: str | Path | None = None) -> Path:
    output = Path(output)
    page = build_report(db, results)
    with atomic_path(output) as tmp:
        tmp.write_text(page)
        os.chmod(tmp, 0o644)  # a page to share: the temp file's private mode would stick after the rename
    return output
