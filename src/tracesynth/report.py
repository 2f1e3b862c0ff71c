"""Render a pipeline's results: one self-contained HTML report (matplotlib PNGs embedded as base64)
and the Markdown summary tables (results.md).

    tracesynth report out/demo -o report.html

It is written for a person deciding whether to trust a synthetic dataset: each plot comes with a
short reading guide that says what "good" looks like. It only formats: every number, summary and
plot series comes computed in the results (tracesynth.evaluate), so a report re-rendered from
results.json is the report the pipeline wrote.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError
from tracesynth.jsonable import jsonable
from tracesynth.tables import FIDELITY_COLUMNS, html_table, markdown_table, mean_std_rows


# -- rendering ------------------------------------------------------------------------------------
def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(v: Any) -> float:
    """None (a NaN after a JSON round trip) back to NaN so plots skip it."""
    return math.nan if v is None else float(v)


def _fig_shares(d: Mapping[str, Any], title: str) -> str:
    plt = _plt()
    names = d["events"]
    srcs = list(d["shares"])
    fig, ax = plt.subplots(figsize=(9, 3.2))
    w = 0.8 / max(1, len(srcs))
    x = np.arange(len(names))
    for i, s in enumerate(srcs):
        ax.bar(x + i * w, d["shares"][s], w, label=s)
    ax.set_xticks(x + 0.4 - w / 2, [n[:22] for n in names], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("share of events")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _png(fig)


def _fig_hist(d: Mapping[str, Any], key: str, title: str, xlabel: str) -> str:
    plt = _plt()
    bins = np.asarray(d["dt_bins"])
    mid = (bins[:-1] + bins[1:]) / 2
    fig, ax = plt.subplots(figsize=(5.5, 3))
    for s, h in d[key].items():
        ax.plot(mid, h, label=s, lw=2 if s == "real" else 1.2, color="black" if s == "real" else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _png(fig)


def _fig_heat(d: Mapping[str, Any], title: str) -> str:
    plt = _plt()
    srcs = list(d["heat"])
    fig, axes = plt.subplots(1, len(srcs), figsize=(3.6 * len(srcs), 3.6), squeeze=False)
    names = [n[:16] for n in d["heat_events"]]
    for ax, s in zip(axes[0], srcs, strict=True):
        ax.imshow(np.asarray(d["heat"][s]), vmin=0, vmax=1, cmap="viridis")
        ax.set_title(s, fontsize=9)
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        ax.set_yticks(range(len(names)), names, fontsize=6)
    fig.suptitle(title, fontsize=10)
    return _png(fig)


def _fig_bars(
    rows: Sequence[Mapping[str, Any]],
    label_keys: Sequence[str],
    value: str,
    title: str,
    ref: float | None = None,
    ylim: tuple[float, float] | None = None,
    beside: tuple[str, str] | None = None,
) -> str:
    """Bars of `value` per row; `beside` = (column, legend label) draws a second, grey bar next to each."""
    plt = _plt()
    labels = [" / ".join(str(r[k]) for k in label_keys if r.get(k) not in (None, "-")) for r in rows]
    vals = [_num(r.get(value)) for r in rows]
    errs = [_num(r.get(f"{value}_std")) for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 0.55 * len(rows) + 2), 3.4))
    x = np.arange(len(rows), dtype=float)
    if beside is None:
        ax.bar(x, vals, yerr=errs, capsize=3, color="#4c72b0")
    else:
        col, name = beside
        b_vals = [_num(r.get(col)) for r in rows]
        b_errs = [_num(r.get(f"{col}_std")) for r in rows]
        ax.bar(x - 0.2, vals, 0.4, yerr=errs, capsize=2, color="#4c72b0", label=value)
        ax.bar(x + 0.2, b_vals, 0.4, yerr=b_errs, capsize=2, color="#999999", label=name)
        ax.legend(fontsize=7)
    if ref is not None:
        ax.axhline(ref, color="red", ls="--", lw=1)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(value)
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=10)
    return _png(fig)


def _fig_scarce(rows: Sequence[Mapping[str, Any]], workload: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    lines: dict[tuple, list] = {}
    for r in rows:
        if r["workload"] == workload:
            lines.setdefault((r["generator"], r["synthetic_x"]), []).append(r)
    for (g, m), rs in sorted(lines.items(), key=lambda kv: (kv[0][0] != "-", str(kv[0]))):
        rs = sorted(rs, key=lambda r: r["budget"])
        label = "real alone" if g == "-" else f"real + {g} x{m}"
        ax.errorbar(
            [r["budget"] * 100 for r in rs],
            [_num(r["macro_f1"]) for r in rs],
            yerr=[_num(r.get("macro_f1_std")) for r in rs],
            label=label,
            marker="o",
            capsize=2,
            lw=2.5 if g == "-" else 1.2,
            color="black" if g == "-" else None,
        )
    ax.set_xscale("log")
    ax.set_xlabel("real training data used (% of the training block)")
    ax.set_ylabel("next-event Macro-F1")
    ax.set_title(f"scarce-data curve: {workload}", fontsize=10)
    ax.legend(fontsize=7)
    return _png(fig)


def _fig_violations(fid: Sequence[Mapping[str, Any]]) -> str | None:
    rows = [r for r in fid if r.get("violation_rate") is not None]
    if not rows:
        return None
    plt = _plt()
    keys = sorted({(r["workload"], r["generator"]) for r in rows if r["variant"] != "reference"})
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(keys) + 2), 3.4))
    x = np.arange(len(keys))
    for j, (variant, color) in enumerate((("raw", "#dd8452"), ("repaired", "#55a868"))):
        v = [
            next(
                (r["violation_rate"] for r in rows if (r["workload"], r["generator"]) == k and r["variant"] == variant),
                np.nan,
            )
            for k in keys
        ]
        ax.bar(x + j * 0.4, v, 0.4, label="before repair" if variant == "raw" else "after repair", color=color)
    ax.set_xticks(x + 0.2, [f"{w} / {g}" for w, g in keys], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("share of events breaking a rule")
    ax.set_title("constraint violations before / after repair", fontsize=10)
    ax.legend(fontsize=7)
    return _png(fig)


def _first(rows: Sequence[Mapping[str, Any]], value: str, **match: Any) -> Any:
    """`value` of the first row whose columns equal `match`, else None."""
    return next((r[value] for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _verdict(t: Mapping[str, Any], generators: Sequence[str]) -> str:
    """A few plain sentences per generator from the headline numbers."""
    items = []
    reg = t.get("regimes_summary", [])
    refcp = [
        r["copied_window_share"]
        for r in t.get("fidelity", [])
        if r["variant"] == "reference" and r.get("copied_window_share") is not None
    ]
    for g in generators:
        bits = []
        mine = [r for r in t.get("discriminator_summary", []) if r["generator"] == g and r["auc"] is not None]
        d = [r["auc"] for r in mine]
        ref = [r["auc_reference"] for r in mine if r.get("auc_reference") is not None]
        if d:
            auc = float(np.mean(d))
            bits.append(
                f"a classifier tells its windows from real ones with AUC {auc:.2f} on average"
                + (f" (two real samples of the same period: {np.mean(ref):.2f})" if ref else "")
                + (" - easy to tell apart" if auc > 0.8 else " - hard to tell apart" if auc < 0.65 else "")
            )
        for wl in sorted({r["workload"] for r in reg}):
            real = _first(reg, "macro_f1", workload=wl, regime="real")
            half = _first(reg, "macro_f1", workload=wl, regime="half_real")
            mix = _first(reg, "macro_f1", workload=wl, generator=g, regime="mix_repaired")
            if mix is None:
                mix = _first(reg, "macro_f1", workload=wl, generator=g, regime="mix_unrepaired")
            if real is not None and mix is not None and half is not None:
                bits.append(
                    f"{wl}: half real + synthetic scores {mix:.3f} Macro-F1 vs {half:.3f} for half real alone "
                    f"and {real:.3f} for all real"
                )
        cp = [
            r["copied_window_share"]
            for r in t.get("fidelity", [])
            if r["generator"] == g and r.get("copied_window_share") is not None
        ]
        if cp:
            bits.append(
                f"{np.mean(cp):.1%} of its 128-event windows copy a training window verbatim"
                + (f" (real held-out data: {np.mean(refcp):.1%})" if refcp else "")
            )
        items.append(f"<li><b>{html.escape(g)}</b>: " + "; ".join(html.escape(b) for b in bits) + ".</li>")
    return "<ul>" + "".join(items) + "</ul>"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-top:.6em}table{border-collapse:collapse;font-size:.82em;
margin:.6em 0}td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}th{background:#f3f3f3}
.guide{background:#f6f8fa;border-left:4px solid #4c72b0;padding:.5em 1em;font-size:.92em}img{max-width:100%}
.note{color:#a05a00}"""


def _guide(text: str) -> str:
    return f"<div class='guide'>{text}</div>"


def _summary_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], values: Sequence[str]) -> str:
    return html_table(mean_std_rows(rows, keys, values), [*keys, *values])


# -- HTML sections: each takes the results and returns its HTML ("" when it has nothing to show) ----
def _section_verdict(results: Mapping[str, Any]) -> str:
    return (
        "<h2>Verdict in brief</h2>"
        + _verdict(results["tables"], results.get("generators", []))
        + _guide(
            "How to read this report: a synthetic dataset is worth using when (1) a classifier "
            "cannot easily tell its windows from real ones (discriminator AUC near 0.5, and no worse than two real "
            "blocks of the same trace), (2) adding it to scarce real data raises the score on held-out <i>real</i> "
            "data (its line stands above 'real alone' in the scarce-data curve), (3) it breaks few of the rules "
            "mined from real traces, and (4) it does not simply copy the training trace (copied-window share and "
            "longest shared run close to what held-out real data shows)."
        )
    )


def _section_discriminator(results: Mapping[str, Any]) -> str:
    dsum = results["tables"].get("discriminator_summary", [])
    if not dsum:
        return ""
    keys = ["workload", "generator", "variant"]
    return "".join(
        [
            "<h2>Discriminator two-sample test</h2>",
            _fig_bars(
                dsum,
                keys,
                "auc",
                "AUC real vs synthetic, and real vs real of the same period (0.5 = same)",
                ref=0.5,
                ylim=(0.0, 1.0),
                beside=("auc_reference", "real vs real reference"),
            ),
            _guide(
                "Blue: a small GRU trained to tell real windows of the period the generator "
                "learned from apart from the generator's windows. 0.5 means it cannot; 1.0 means every window is "
                "told apart. Grey: the same classifier and budget telling two real samples of that same period "
                "apart (interleaved small time blocks), the level a perfect generator would reach."
            ),
            _summary_table(dsum, keys, ["auc", "auc_reference"]),
        ]
    )


def _section_regimes(results: Mapping[str, Any]) -> str:
    rsum = results["tables"].get("regimes_summary", [])
    if not rsum:
        return ""
    keys = ["workload", "regime", "generator"]
    return "".join(
        [
            "<h2>Next-event prediction per training regime</h2>",
            _fig_bars(rsum, keys, "macro_f1", "Macro-F1 on held-out real data"),
            _guide(
                "Same classifier, same number of training steps; only the training data "
                "differs. Compare '50/50' bars with 'half_real' (the same real data without synthetic): "
                "synthetic data helps only where it lifts the bar above half_real. This task saturates on little "
                "data, so small differences here do not rank generators; the discriminator and scarce-data curve "
                "do."
            ),
            _summary_table(rsum, keys, ["macro_f1", "accuracy"]),
        ]
    )


def _section_scarce(results: Mapping[str, Any]) -> str:
    ssum = results["tables"].get("scarce_summary", [])
    if not ssum:
        return ""
    return "".join(
        [
            "<h2>Scarce-data curve</h2>",
            *(_fig_scarce(ssum, wl) for wl in sorted({r["workload"] for r in ssum})),
            _guide(
                "Black: real data alone at each budget. Coloured: the same real data plus "
                "synthetic data from a generator fitted on that budget only (x1 / x4 as many events). Synthetic "
                "data is worth using where a coloured line stands above the black one."
            ),
            _summary_table(ssum, ["workload", "budget", "generator", "synthetic_x"], ["macro_f1"]),
        ]
    )


def _section_workload_id(results: Mapping[str, Any]) -> str:
    wsum = results["tables"].get("workload_id_summary", [])
    if not wsum:
        return ""
    return "".join(
        [
            "<h2>Workload identification (train on one source, test on real)</h2>",
            _fig_bars(wsum, ["train_on"], "macro_f1", "workload-ID Macro-F1 on real windows", ylim=(0, 1)),
            _guide(
                "A classifier learns which workload a window comes from using only the named "
                "source, and is scored on real windows. Close to the 'real' bar means the synthetic traces keep "
                "what distinguishes one workload from another."
            ),
            _summary_table(wsum, ["train_on"], ["macro_f1", "accuracy"]),
        ]
    )


def _section_fidelity(results: Mapping[str, Any]) -> str:
    fid = results["tables"].get("fidelity", [])
    if not fid:
        return ""
    out = ["<h2>Fidelity, constraints and memorisation</h2>"]
    v = _fig_violations(fid)
    if v:
        out.append(v)
        out.append(
            _guide(
                "Share of events that break a rule mined from the real training data "
                "(impossible transitions, unpaired syscalls, a thread on two CPUs at once...). Repair should bring "
                "it to (near) zero; the real held-out block shows the rules' own false-alarm level."
            )
        )
    out.append(html_table(fid, FIDELITY_COLUMNS))
    out.append(
        _guide(
            "JSD: Jensen-Shannon divergence of event-type (1-gram) and 2/3-gram "
            "distributions (0 = identical, 1 = disjoint). dt / latency: Wasserstein distance between "
            "log10-nanosecond distributions (1.0 = a tenfold shift). Memorisation: longest run of events "
            "shared verbatim with the training data and the share of 128-event windows copied from it; "
            "compare with the real held-out 'reference' row, since kernel traces repeat themselves."
        )
    )
    return "".join(out)


def _section_distributions(results: Mapping[str, Any]) -> str:
    out = []
    for wl, d in results.get("plots", {}).items():
        out.append(f"<h2>Distributions: {html.escape(wl)}</h2>")
        out.append(_fig_shares(d, f"{wl}: event types (top {len(d['events'])} in real data)"))
        out.append(_fig_hist(d, "dt_hist", f"{wl}: gap to previous event", "log10(1 + dt / ns)"))
        if any(sum(h) > 0 for h in d["lat_hist"].values()):
            out.append(_fig_hist(d, "lat_hist", f"{wl}: syscall latency (entry to exit)", "log10(1 + latency / ns)"))
        out.append(_fig_heat(d, f"{wl}: transition probabilities among the top {len(d['heat_events'])} events"))
        out.append(
            _guide(
                "Bars and curves should overlap the real ones; in the heatmaps (row: event, "
                "column: the event that follows) a synthetic trace should show the same bright cells as the "
                "real one. Cells bright only in a synthetic map are transitions the real trace never made."
            )
        )
    return "".join(out)


def _section_cost(results: Mapping[str, Any]) -> str:
    t = results["tables"]
    out = []
    if t.get("generators"):
        out.append("<h2>Generator cost</h2>" + html_table(t["generators"]))
    if t.get("sweep"):
        out.append("<h2>Sweep</h2>" + html_table(t["sweep"]))
    tm = results.get("timings", {})
    out.append(
        "<p>Timings (s): " + html.escape(", ".join(f"{k} {v:.0f}" for k, v in tm.items() if v is not None)) + "</p>"
    )
    return "".join(out)


SECTIONS = (
    _section_verdict,
    _section_discriminator,
    _section_regimes,
    _section_scarce,
    _section_workload_id,
    _section_fidelity,
    _section_distributions,
    _section_cost,
)


def render_html(results: Mapping[str, Any]) -> str:
    name = html.escape(str(results.get("config", {}).get("name", "pipeline")))
    out = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>tracesynth report: {name}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>tracesynth report: {name}</h1>",
        *(f"<p class='note'>note: {html.escape(n)}</p>" for n in results.get("notes", [])),
        *(part for section in SECTIONS if (part := section(results))),
        "</body></html>",
    ]
    return "\n".join(out)


# -- Markdown -------------------------------------------------------------------------------------
SWEEP_VALUES = ("macro_f1", "auc", "auc_reference", "jsd_3gram", "violation_rate_raw", "fit_s", "train_steps", "params")


def results_markdown(results: Mapping[str, Any]) -> str:
    """The summary tables as Markdown (what the README's results table is cut from)."""
    t = results["tables"]
    parts = [f"# Results: {results['config'].get('name', 'pipeline')}\n"]
    parts += [f"- note: {n}\n" for n in results.get("notes", [])]

    def summary(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], values: Sequence[str]) -> str:
        return markdown_table(mean_std_rows(rows, keys, values))

    if t["regimes_summary"]:
        parts.append("\n## Next-event prediction (Macro-F1 on held-out real data, mean ± std over seeds)\n\n")
        parts.append(summary(t["regimes_summary"], ["workload", "regime", "generator"], ["macro_f1", "accuracy"]))
    if t["discriminator_summary"]:
        parts.append(
            "\n## Discriminator two-sample test (AUC; 0.5 = indistinguishable from real)\n\n"
            "`auc`: synthetic vs real windows of the period the generator learned from; `auc_reference`: real vs "
            "real, two interleaved sets of small time blocks of that same period, same classifier and budget. "
            "A sample is as good as real data where its `auc` reaches `auc_reference`.\n\n"
        )
        parts.append(
            summary(t["discriminator_summary"], ["workload", "generator", "variant"], ["auc", "auc_reference"])
        )
    if t["workload_id_summary"]:
        parts.append("\n## Workload identification (train on the named source, test on real)\n\n")
        parts.append(summary(t["workload_id_summary"], ["train_on"], ["macro_f1", "accuracy"]))
    if t["fidelity"]:
        parts.append("\n## Fidelity and privacy (against the real training block; lower is closer)\n\n")
        parts.append(markdown_table(t["fidelity"], FIDELITY_COLUMNS))
    if t["scarce_summary"]:
        parts.append("\n## Scarce-data curve (next-event Macro-F1)\n\n")
        parts.append(summary(t["scarce_summary"], ["workload", "budget", "generator", "synthetic_x"], ["macro_f1"]))
    if t["generators"]:
        parts.append("\n## Generator cost\n\n")
        parts.append(markdown_table(t["generators"]))
    if t.get("sweep_summary"):
        parts.append("\n## Sweep\n\n")
        parts.append(
            "`macro_f1`: next-event Macro-F1 on the held-out real block (rows `real`/`half_real`: real data alone; "
            "variants: half real + the variant's repaired sample, 50/50); `auc` / `auc_reference`: discriminator "
            "against the same-period real-vs-real reference; `violation_rate_raw`: before repair; `fit_s`, "
            "`train_steps`, `params`: compute cost.\n\n"
        )
        parts.append(summary(t["sweep_summary"], ["workload", "variant"], SWEEP_VALUES))
    tm = results.get("timings", {})
    parts.append("\n## Time\n\n" + ", ".join(f"{k} {v:.0f}" for k, v in tm.items()) + "\n")
    return "".join(parts)


# -- files ----------------------------------------------------------------------------------------
def write_report(results: Mapping[str, Any], path: str | Path) -> Path:
    """Render results (as produced by tracesynth.evaluate.pipeline) into one HTML file, atomically.

    The results go through their JSON form first, so this report and one re-rendered from
    results.json are the same."""
    path = Path(path)
    text = render_html(jsonable(results))
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def load_results(path: str | Path) -> dict[str, Any]:
    """results.json, or a directory holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise TraceSynthError("no results.json here (run `tracesynth run CONFIG` or the demo first)", p)
    try:
        doc = json.loads(p.read_text())
    except ValueError as exc:
        raise TraceSynthError(f"not valid JSON ({exc})", p) from None
    if not isinstance(doc, dict) or "tables" not in doc:
        raise TraceSynthError("not a tracesynth results file (no 'tables')", p)
    return doc
