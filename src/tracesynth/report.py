"""One self-contained HTML report (matplotlib PNGs embedded as base64) from a pipeline's results.

    tracesynth report out/demo -o report.html

It is written for a person deciding whether to trust a synthetic dataset: each plot comes with a
short reading guide that says what "good" looks like.
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
from tracesynth.evaluate.metrics import FIDELITY_COLUMNS
from tracesynth.trace import Trace

TOP_EVENTS = 15
HEAT_EVENTS = 12
DT_BINS = np.arange(0.0, 10.25, 0.25)  # log10(1 + ns): 1 ns .. 10 s


# -- plot data (computed by the pipeline while the traces are in memory) --------------------------
def _shares(trace: Trace, names: Sequence[str]) -> list[float]:
    counts = trace.event_counts()
    n = max(1, len(trace))
    return [counts.get(k, 0) / n for k in names]


def _hist(values: np.ndarray, bins: np.ndarray) -> list[float]:
    if not len(values):
        return [0.0] * (len(bins) - 1)
    h, _ = np.histogram(np.clip(values, bins[0], bins[-1] - 1e-9), bins=bins)
    return (h / max(1, h.sum())).tolist()


def _transitions(trace: Trace, names: Sequence[str]) -> list[list[float]]:
    codes, voc = trace.codes("event")
    idx = {n: i for i, n in enumerate(names)}
    lut = np.asarray([idx.get(v, -1) for v in voc] or [-1], dtype=np.int64)
    c = lut[codes] if len(codes) else np.zeros(0, np.int64)
    a, b = c[:-1], c[1:]
    ok = (a >= 0) & (b >= 0)
    k = len(names)
    m = np.bincount(a[ok] * k + b[ok], minlength=k * k).reshape(k, k).astype(float)
    return (m / np.maximum(m.sum(1, keepdims=True), 1)).tolist()


def plot_data(real: Trace, synth: Mapping[str, Trace], repaired: Mapping[str, Trace] | None = None) -> dict[str, Any]:
    """Small, JSON-ready summaries of a real trace and each generator's sample, for the report's plots."""
    from tracesynth.evaluate.metrics import log_dt, syscall_latencies

    names = list(real.event_counts())[:TOP_EVENTS]
    heat = names[:HEAT_EVENTS]
    sources = {"real": real, **synth}
    for g, t in (repaired or {}).items():
        sources[f"{g} (repaired)"] = t

    def lat(t: Trace) -> np.ndarray:
        v = syscall_latencies(t)
        return np.log10(1 + np.concatenate(list(v.values()))) if v else np.zeros(0)

    return {
        "events": names,
        "shares": {k: _shares(t, names) for k, t in sources.items()},
        "dt_bins": DT_BINS.tolist(),
        "dt_hist": {k: _hist(log_dt(t)[1:], DT_BINS) for k, t in sources.items()},
        "lat_hist": {k: _hist(lat(t), DT_BINS) for k, t in sources.items()},
        "heat_events": heat,
        "heat": {k: _transitions(t, heat) for k, t in sources.items() if "(repaired)" not in k},
    }


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


def _table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    def f(v: Any) -> str:
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else f"{v:.4g}"
        return html.escape("" if v is None else str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{f(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _ms(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], values: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        o = {k: r.get(k) for k in keys}
        for v in values:
            m, s = r.get(v), r.get(f"{v}_std") or 0.0
            o[v] = "n/a" if m is None or (isinstance(m, float) and math.isnan(m)) else f"{m:.3f} ± {s:.3f}"
        out.append(o)
    return out


def _verdict(t: Mapping[str, Any], generators: Sequence[str]) -> str:
    """A few plain sentences per generator from the headline numbers."""
    items = []
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
        reg = t.get("regimes_summary", [])
        for wl in sorted({r["workload"] for r in reg}):
            real = next((r["macro_f1"] for r in reg if r["workload"] == wl and r["regime"] == "real"), None)
            half = next((r["macro_f1"] for r in reg if r["workload"] == wl and r["regime"] == "half_real"), None)
            mix = next(
                (
                    r["macro_f1"]
                    for r in reg
                    if r["workload"] == wl and r["generator"] == g and r["regime"] in ("mix_repaired",)
                ),
                None,
            )
            mix = (
                mix
                if mix is not None
                else next(
                    (
                        r["macro_f1"]
                        for r in reg
                        if r["workload"] == wl and r["generator"] == g and r["regime"] == "mix_unrepaired"
                    ),
                    None,
                )
            )
            if real is not None and mix is not None and half is not None:
                bits.append(
                    f"{wl}: half real + synthetic scores {mix:.3f} Macro-F1 vs {half:.3f} for half real alone "
                    f"and {real:.3f} for all real"
                )
        fid = [r for r in t.get("fidelity", []) if r["generator"] == g]
        cp = [r["copied_window_share"] for r in fid if r.get("copied_window_share") is not None]
        refcp = [
            r["copied_window_share"]
            for r in t.get("fidelity", [])
            if r["variant"] == "reference" and r.get("copied_window_share") is not None
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


def render_html(results: Mapping[str, Any]) -> str:
    t = results["tables"]
    gens = results.get("generators", [])
    name = results.get("config", {}).get("name", "pipeline")
    out = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>tracesynth report: {html.escape(name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>tracesynth report: {html.escape(name)}</h1>",
    ]
    for n in results.get("notes", []):
        out.append(f"<p class='note'>note: {html.escape(n)}</p>")
    out.append("<h2>Verdict in brief</h2>" + _verdict(t, gens))
    out.append(
        "<div class='guide'>How to read this report: a synthetic dataset is worth using when (1) a classifier "
        "cannot easily tell its windows from real ones (discriminator AUC near 0.5, and no worse than two real "
        "blocks of the same trace), (2) adding it to scarce real data raises the score on held-out <i>real</i> data "
        "(its line stands above 'real alone' in the scarce-data curve), (3) it breaks few of the rules mined "
        "from real traces, and (4) it does not simply copy the training trace (copied-window share and longest "
        "shared run close to what held-out real data shows).</div>"
    )
    dsum = t.get("discriminator_summary", [])
    if dsum:
        out.append("<h2>Discriminator two-sample test</h2>")
        out.append(
            _fig_bars(
                dsum,
                ["workload", "generator", "variant"],
                "auc",
                "AUC real vs synthetic, and real vs real of the same period (0.5 = same)",
                ref=0.5,
                ylim=(0.0, 1.0),
                beside=("auc_reference", "real vs real reference"),
            )
        )
        out.append(
            "<div class='guide'>Blue: a small GRU trained to tell real windows of the period the generator "
            "learned from apart from the generator's windows. 0.5 means it cannot; 1.0 means every window is "
            "told apart. Grey: the same classifier and budget telling two real samples of that same period "
            "apart (interleaved small time blocks), the level a perfect generator would reach.</div>"
        )
        out.append(
            _table(
                _ms(dsum, ["workload", "generator", "variant"], ["auc", "auc_reference"]),
                ["workload", "generator", "variant", "auc", "auc_reference"],
            )
        )
    rsum = t.get("regimes_summary", [])
    if rsum:
        out.append("<h2>Next-event prediction per training regime</h2>")
        out.append(_fig_bars(rsum, ["workload", "regime", "generator"], "macro_f1", "Macro-F1 on held-out real data"))
        out.append(
            "<div class='guide'>Same classifier, same number of training steps; only the training data "
            "differs. Compare '50/50' bars with 'half_real' (the same real data without synthetic): "
            "synthetic data helps only where it lifts the bar above half_real. This task saturates on little "
            "data, so small differences here do not rank generators; the discriminator and scarce-data curve "
            "do.</div>"
        )
        out.append(
            _table(
                _ms(rsum, ["workload", "regime", "generator"], ["macro_f1", "accuracy"]),
                ["workload", "regime", "generator", "macro_f1", "accuracy"],
            )
        )
    ssum = t.get("scarce_summary", [])
    if ssum:
        out.append("<h2>Scarce-data curve</h2>")
        for wl in sorted({r["workload"] for r in ssum}):
            out.append(_fig_scarce(ssum, wl))
        out.append(
            "<div class='guide'>Black: real data alone at each budget. Coloured: the same real data plus "
            "synthetic data from a generator fitted on that budget only (x1 / x4 as many events). Synthetic "
            "data is worth using where a coloured line stands above the black one.</div>"
        )
        out.append(
            _table(
                _ms(ssum, ["workload", "budget", "generator", "synthetic_x"], ["macro_f1"]),
                ["workload", "budget", "generator", "synthetic_x", "macro_f1"],
            )
        )
    wsum = t.get("workload_id_summary", [])
    if wsum:
        out.append("<h2>Workload identification (train on one source, test on real)</h2>")
        out.append(_fig_bars(wsum, ["train_on"], "macro_f1", "workload-ID Macro-F1 on real windows", ylim=(0, 1)))
        out.append(
            "<div class='guide'>A classifier learns which workload a window comes from using only the named "
            "source, and is scored on real windows. Close to the 'real' bar means the synthetic traces keep "
            "what distinguishes one workload from another.</div>"
        )
        out.append(_table(_ms(wsum, ["train_on"], ["macro_f1", "accuracy"]), ["train_on", "macro_f1", "accuracy"]))
    fid = t.get("fidelity", [])
    if fid:
        out.append("<h2>Fidelity, constraints and memorisation</h2>")
        v = _fig_violations(fid)
        if v:
            out.append(v)
            out.append(
                "<div class='guide'>Share of events that break a rule mined from the real training data "
                "(impossible transitions, unpaired syscalls, a thread on two CPUs at once...). Repair should bring "
                "it to (near) zero; the real held-out block shows the rules' own false-alarm level.</div>"
            )
        out.append(_table(fid, FIDELITY_COLUMNS))
        out.append(
            "<div class='guide'>JSD: Jensen-Shannon divergence of event-type (1-gram) and 2/3-gram "
            "distributions (0 = identical, 1 = disjoint). dt / latency: Wasserstein distance between "
            "log10-nanosecond distributions (1.0 = a tenfold shift). Memorisation: longest run of events "
            "shared verbatim with the training data and the share of 128-event windows copied from it; "
            "compare with the real held-out 'reference' row, since kernel traces repeat themselves.</div>"
        )
    for wl, d in results.get("plots", {}).items():
        out.append(f"<h2>Distributions: {html.escape(wl)}</h2>")
        out.append(_fig_shares(d, f"{wl}: event types (top {len(d['events'])} in real data)"))
        out.append(_fig_hist(d, "dt_hist", f"{wl}: gap to previous event", "log10(1 + dt / ns)"))
        if any(sum(h) > 0 for h in d["lat_hist"].values()):
            out.append(_fig_hist(d, "lat_hist", f"{wl}: syscall latency (entry to exit)", "log10(1 + latency / ns)"))
        out.append(_fig_heat(d, f"{wl}: transition probabilities among the top {len(d['heat_events'])} events"))
        out.append(
            "<div class='guide'>Bars and curves should overlap the real ones; in the heatmaps (row: event, "
            "column: the event that follows) a synthetic trace should show the same bright cells as the "
            "real one. Cells bright only in a synthetic map are transitions the real trace never made.</div>"
        )
    gr = t.get("generators", [])
    if gr:
        out.append("<h2>Generator cost</h2>" + _table(gr, list(gr[0].keys())))
    if t.get("sweep"):
        out.append("<h2>Sweep</h2>" + _table(t["sweep"], list(t["sweep"][0].keys())))
    tm = results.get("timings", {})
    out.append(
        "<p>Timings (s): " + html.escape(", ".join(f"{k} {v:.0f}" for k, v in tm.items() if v is not None)) + "</p>"
    )
    out.append("</body></html>")
    return "\n".join(out)


def write_report(results: Mapping[str, Any], path: str | Path) -> Path:
    """Render results (as produced by tracesynth.evaluate.pipeline) into one HTML file, atomically."""
    path = Path(path)
    text = render_html(json.loads(json.dumps(results, default=_default)))
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def _default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


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
