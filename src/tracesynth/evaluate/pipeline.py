"""The whole pipeline, driven by a small JSON/TOML config: train, sample, repair, evaluate, report.

    from tracesynth.evaluate.pipeline import run_pipeline
    report = run_pipeline("configs/demo.json", "out/demo")   # -> out/demo/report.html

Outputs (written into a temporary sibling directory and renamed into place only on success):
    results.json      every row, the config, timings and the plot data
    tables/*.csv      one CSV per table (raw rows and mean/std summaries)
    results.md        the summary tables in Markdown
    report.html       one self-contained HTML report (tracesynth.report)
"""

from __future__ import annotations

import copy
import csv
import json
import math
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError
from tracesynth.evaluate import experiments as ex
from tracesynth.evaluate.classifier import ClassifierConfig
from tracesynth.evaluate.metrics import FIDELITY_COLUMNS
from tracesynth.evaluate.windows import Vocab, split_trace
from tracesynth.trace import Trace

DEFAULTS: dict[str, Any] = {
    "name": "pipeline",
    "comment": None,  # free text (e.g. what an experiment config cut to fit its time budget)
    "traces": None,  # list of paths or {"path", "workload"}; None: the shipped dataset (data/)
    "data": {"dir": "data", "workloads": None, "max_events": 60000, "skip_events": 0},
    "split": [0.8, 0.1, 0.1],
    "context": 128,
    "seeds": [0, 1],
    "generators": {"markov": {"kind": "markov", "order": 4}},
    "sample_factor": 1.0,  # synthetic events per real training event
    "repair": True,
    "classifier": {"embed": 32, "hidden": 48, "steps": 150, "batch": 64, "lr": 3e-3},
    "max_train_windows": 8000,
    "max_test_windows": 2000,
    "discriminator": {"enabled": True, "max_windows": 3000},
    "regimes": {"enabled": True, "workloads": None, "only": None},  # only: a subset of experiments.REGIMES
    "workload_id": {"enabled": True, "per_class": 2000},
    "scarce": {"enabled": True, "workloads": None, "budgets": [0.02, 0.05, 0.1, 0.25, 1.0], "multipliers": [1, 4]},
    "sweep": None,  # {"name", "generator", "variants": {label: {config overrides}}}
    # small models on a shared 2-core CPU run faster on one thread (two threads spin against each other)
    "torch_threads": 1,
}


# -- config ---------------------------------------------------------------------------------------
def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict) and k != "generators":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_config(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Merge a JSON/TOML file (or dict) over DEFAULTS; `_base` is where relative paths start."""
    if isinstance(config, Mapping):
        cfg = _merge(DEFAULTS, config)
        cfg.setdefault("_base", str(Path.cwd()))
        return cfg
    path = Path(config)
    if not path.is_file():
        raise TraceSynthError("no such config file", path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError, OSError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise TraceSynthError(f"not a valid {kind} config ({exc})", path) from None
    if not isinstance(raw, dict):
        raise TraceSynthError("config must be an object of settings", path)
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise TraceSynthError(f"unknown config key(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})", path)
    cfg = _merge(DEFAULTS, raw)
    cfg["_base"] = str(path.resolve().parent)
    return cfg


def _resolve(p: str | Path, base: str) -> Path:
    p = Path(p)
    if p.is_absolute() or p.exists():
        return p
    from tracesynth.resources import source_checkout

    # a shipped config names the dataset as "data": found beside the config, here, or in the checkout
    for root in (Path(base), Path.cwd(), source_checkout()):
        if root is not None and (root / p).exists():
            return root / p
    return Path(base) / p


def load_sources(cfg: Mapping[str, Any]) -> dict[str, Trace]:
    """workload name -> real trace (one contiguous slice of at most data.max_events events)."""
    from tracesynth.io import read_trace

    entries: list[tuple[Path, str | None]] = []
    if cfg.get("traces"):
        for e in cfg["traces"]:
            if isinstance(e, Mapping):
                entries.append((_resolve(e["path"], cfg["_base"]), e.get("workload")))
            else:
                entries.append((_resolve(e, cfg["_base"]), None))
    else:
        d = _resolve(cfg["data"]["dir"], cfg["_base"])
        manifest = d / "manifest.json"
        if manifest.is_file():
            entries = _manifest_entries(manifest)
        if not entries:
            entries = [(p, None) for p in sorted(d.glob("*.parquet"))]
        if not entries:
            raise TraceSynthError("no traces: the dataset directory holds no manifest.json or *.parquet", d)
    want = cfg["data"].get("workloads")
    skip, cap = int(cfg["data"].get("skip_events") or 0), cfg["data"].get("max_events")
    out: dict[str, Trace] = {}
    for path, name in entries:
        if not path.exists():
            raise TraceSynthError("trace listed in the config/manifest does not exist", path)
        if want and (name or path.stem) not in want and not any(w in path.stem for w in want):
            continue
        trace = read_trace(path)
        name = name or str(trace.metadata.get("workload") or path.stem)
        if want and name not in want:
            continue
        if name in out:  # one recording per workload keeps time contiguous
            continue
        stop = len(trace) if not cap else min(len(trace), skip + int(cap))
        out[name] = trace.slice(min(skip, len(trace)), stop)
    if not out:
        raise TraceSynthError(f"no traces left after choosing workloads {want}")
    return out


def _manifest_entries(manifest: Path) -> list[tuple[Path, str | None]]:
    """Accept the common manifest shapes: a list of entries, or {"traces"|"workloads": list|dict}."""
    try:
        doc = json.loads(manifest.read_text())
    except ValueError as exc:
        raise TraceSynthError(f"not valid JSON ({exc})", manifest) from None
    items: Any = doc
    if isinstance(doc, Mapping):
        for key in ("traces", "workloads", "files", "entries"):
            if key in doc:
                items = doc[key]
                break
    if isinstance(items, Mapping):
        items = [
            dict(v, workload=v.get("workload", k)) if isinstance(v, Mapping) else {"path": v, "workload": k}
            for k, v in items.items()
        ]
    out = []
    for it in items if isinstance(items, list) else []:
        if isinstance(it, str):
            out.append((manifest.parent / it, None))
        elif isinstance(it, Mapping):
            p = it.get("path") or it.get("file") or it.get("parquet")
            if p:
                out.append((manifest.parent / p, it.get("workload") or it.get("name")))
    return out


# -- outputs --------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) if isinstance(r.get(k), float) else r.get(k) for k in cols})


def markdown_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str] | None = None) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = list(cols or rows[0].keys())
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _mean_std_cols(rows: list[dict[str, Any]], keys: Sequence[str], values: Sequence[str]) -> list[dict[str, Any]]:
    """Summary rows with 'value' rendered as 'mean ± std' strings for Markdown."""
    out = []
    for r in rows:
        o = {k: r[k] for k in keys}
        for v in values:
            o[v] = f"{r[v]:.4f} ± {r[f'{v}_std']:.4f}" if not math.isnan(r[v]) else "n/a"
        o["n"] = r["n"]
        out.append(o)
    return out


def _pm(row: Mapping[str, Any], v: str) -> str:
    """'mean ± std' of a summary row's value; the mean alone where the spread is 0 (one fit, many seeds)."""
    m, sd = row.get(v), row.get(f"{v}_std") or 0.0
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "n/a"
    return f"{m:.4g} ± {sd:.2g}" if sd else f"{m:.4g}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating | float):
        return None if math.isnan(float(x)) else float(x)
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    return x


# -- the pipeline ---------------------------------------------------------------------------------
def _seeds(cfg: Mapping[str, Any], task: str) -> list[int]:
    """A task's own seeds when its section names them, else the global ones."""
    return [int(s) for s in (cfg[task].get("seeds") or cfg["seeds"])]


class _Stages:
    """One rich progress display: an overall bar per stage plus a bar for classifier steps."""

    def __init__(self, progress: Progress):
        self.p = progress
        self.cls_task = progress.add_task("classifier steps", total=None, visible=False)

    def stage(self, desc: str, total: int) -> Any:
        if not self.p.console.is_terminal:  # logs and CI: one line per stage instead of a live bar
            self.p.console.print(f"{time.strftime('%H:%M:%S')} {desc} ({total})", highlight=False)
        return self.p.add_task(desc, total=total)

    def tick(self) -> None:
        self.p.advance(self.cls_task)


def run_pipeline(config: str | Path | Mapping[str, Any], out_dir: str | Path, console: Console | None = None) -> Path:
    """Run train -> sample -> repair -> evaluate -> report; returns the path of report.html."""
    cfg = load_config(config)
    console = console or Console(stderr=True)
    out_dir = Path(out_dir)
    import torch

    threads = torch.get_num_threads()
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    try:
        return _run(cfg, out_dir, console)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: dict[str, Any], out_dir: Path, console: Console) -> Path:
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        console.print(f"[yellow]note:[/] {msg}", highlight=False)

    bad = sorted(set(cfg["regimes"].get("only") or []) - set(ex.REGIMES))
    if bad:
        raise TraceSynthError(f"unknown regime(s) {', '.join(bad)} in regimes.only (known: {', '.join(ex.REGIMES)})")
    ccfg = ClassifierConfig(**cfg["classifier"])
    seeds = [int(s) for s in cfg["seeds"]]
    ctx = int(cfg["context"])
    specs: dict[str, dict[str, Any]] = {}
    for name, spec in cfg["generators"].items():
        spec = dict(spec, name=name)
        if spec.get("kind") == "diffusion":
            why = ex.diffusion_available()
            if why:
                note(f"the diffusion model is absent ({why}); evaluating the Markov baseline only")
                continue
        if spec.get("kind") == "sdv_par":
            from tracesynth.baselines.sdv_par import sdv_available

            why = sdv_available()
            if why:
                note(f"SDV's PARSynthesizer is absent ({why}); pip install sdv to score it")
                continue
        specs[name] = spec
    if not specs:
        raise TraceSynthError("no generator left to evaluate (check the config's generators)")
    miner = ex.load_rules_miner() if cfg["repair"] else None
    if cfg["repair"] and miner is None:
        note("tracesynth.constraints is absent: no rules, no repair, no violation rates")

    t0 = time.perf_counter()
    sources = load_sources(cfg)
    timings["load_s"] = time.perf_counter() - t0
    console.print(
        "pipeline: "
        + ", ".join(f"{k} ({len(v):,} events)" for k, v in sources.items())
        + f"; generators: {', '.join(specs)}"
    )
    results: dict[str, Any] = {"config": {k: v for k, v in cfg.items() if k != "_base"}, "notes": notes}
    fid_rows: list[dict[str, Any]] = []
    disc_rows: list[dict[str, Any]] = []
    reg_rows: list[dict[str, Any]] = []
    scarce: list[dict[str, Any]] = []
    wid_rows: list[dict[str, Any]] = []
    gen_rows: list[dict[str, Any]] = []
    sweep_rows: list[dict[str, Any]] = []
    plots: dict[str, Any] = {}
    from tracesynth.report import plot_data

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        st = _Stages(progress)
        # 1. split, rules, fit, sample, repair
        data: dict[str, ex.WorkloadData] = {}
        synth: dict[str, dict[str, ex.Synthetic]] = {}
        task = st.stage("fit + sample + repair", len(sources) * len(specs))
        t0 = time.perf_counter()
        for wl, trace in sources.items():
            split = split_trace(trace, cfg["split"])
            rules = miner[0]([split.train]) if miner else None
            data[wl] = ex.prepare_workload(wl, split, ctx, int(cfg["max_test_windows"]), rules=rules)
            synth[wl] = {}
            n_sample = max(ctx * 4, int(len(split.train) * float(cfg["sample_factor"])))
            for g, spec in specs.items():
                if cfg.get("sweep") and g == cfg["sweep"]["generator"]:  # the sweep fits each of its variants
                    progress.advance(task)
                    continue
                progress.update(task, description=f"fit + sample + repair: {g} on {wl}")
                n = int(spec.get("sample_events") or n_sample)
                try:
                    s = ex.fit_and_sample(spec, split.train, n, seed=0, rules=rules, fit_events=spec.get("fit_events"))
                except TraceSynthError as exc:
                    note(f"{g} on {wl} failed: {exc}")
                    progress.advance(task)
                    continue
                synth[wl][g] = s
                gen_rows.append(
                    {
                        "workload": wl,
                        "generator": g,
                        "fit_s": s.fit_s,
                        "sample_s": s.sample_s,
                        "repair_s": s.repair_s,
                        "events": len(s.raw),
                        "params": s.params,
                    }
                )
                progress.advance(task)
            plots[wl] = plot_data(
                split.train,
                {g: s.raw for g, s in synth[wl].items()},
                {g: s.repaired for g, s in synth[wl].items() if s.repaired is not None},
            )
        timings["generate_s"] = time.perf_counter() - t0

        # 2. fidelity, violations, memorisation
        t0 = time.perf_counter()
        task = st.stage("fidelity + privacy metrics", len(data))
        for wl, wd in data.items():
            fid_rows += ex.fidelity_rows(wd, synth[wl], ctx)
            progress.advance(task)
        timings["metrics_s"] = time.perf_counter() - t0

        # 3. classifier tasks
        progress.update(st.cls_task, visible=True)
        if cfg["discriminator"]["enabled"]:
            t0 = time.perf_counter()
            task = st.stage("discriminator (real vs synthetic)", len(data))
            for wl, wd in data.items():
                disc_rows += ex.discriminator_rows(
                    wd, synth[wl], ccfg, _seeds(cfg, "discriminator"), int(cfg["discriminator"]["max_windows"]), st.tick
                )
                progress.advance(task)
            timings["discriminator_s"] = time.perf_counter() - t0
        if cfg["regimes"]["enabled"]:
            t0 = time.perf_counter()
            wls = [w for w in (cfg["regimes"]["workloads"] or list(data)) if w in data]
            task = st.stage("next-event regimes", len(wls))
            for wl in wls:
                reg_rows += ex.regime_rows(
                    data[wl],
                    synth[wl],
                    ccfg,
                    _seeds(cfg, "regimes"),
                    int(cfg["max_train_windows"]),
                    st.tick,
                    cfg["regimes"].get("only"),
                )
                progress.advance(task)
            timings["regimes_s"] = time.perf_counter() - t0
        if cfg["workload_id"]["enabled"] and len(data) >= 2:
            t0 = time.perf_counter()
            task = st.stage("workload identification", 1)
            vocab = Vocab.from_traces([wd.split.train for wd in data.values()])
            shared = {
                wl: ex.prepare_workload(wl, wd.split, ctx, int(cfg["max_test_windows"]), vocab=vocab, rules=wd.rules)
                for wl, wd in data.items()
            }
            wid_rows = ex.workload_id_rows(
                shared, vocab, synth, ccfg, _seeds(cfg, "workload_id"), int(cfg["workload_id"]["per_class"]), st.tick
            )
            progress.advance(task)
            timings["workload_id_s"] = time.perf_counter() - t0
        if cfg["scarce"]["enabled"]:
            t0 = time.perf_counter()
            wls = [w for w in (cfg["scarce"]["workloads"] or list(data)) if w in data]
            task = st.stage("scarce-data curve", len(wls))
            for wl in wls:
                scarce += ex.scarce_rows(
                    data[wl],
                    specs,
                    cfg["scarce"]["budgets"],
                    cfg["scarce"]["multipliers"],
                    ccfg,
                    _seeds(cfg, "scarce"),
                    int(cfg["max_train_windows"]),
                    st.tick,
                    note,
                )
                progress.advance(task)
            timings["scarce_s"] = time.perf_counter() - t0
        if cfg.get("sweep"):
            t0 = time.perf_counter()
            sweep_rows = run_sweep(cfg, data, ccfg, seeds, st, note)
            timings["sweep_s"] = time.perf_counter() - t0

    timings["total_s"] = time.perf_counter() - t_start
    tables = {
        "generators": gen_rows,
        "fidelity": fid_rows,
        "discriminator": disc_rows,
        "discriminator_summary": ex.summarise(
            disc_rows, ["workload", "generator", "variant"], ["auc", "auc_reference"]
        ),
        "regimes": reg_rows,
        "regimes_summary": ex.summarise(reg_rows, ["workload", "regime", "generator"], ["macro_f1", "accuracy"]),
        "workload_id": wid_rows,
        "workload_id_summary": ex.summarise(wid_rows, ["train_on"], ["macro_f1", "accuracy"]),
        "scarce": scarce,
        "scarce_summary": ex.summarise(
            scarce, ["workload", "budget", "generator", "synthetic_x"], ["macro_f1", "accuracy"]
        ),
        "sweep": sweep_rows,
    }
    results.update({"tables": tables, "timings": timings, "plots": plots, "generators": list(specs)})
    with atomic_path(out_dir, directory=True, contents=("tables", "results.json", "results.md", "report.html")) as tmp:
        (tmp / "tables").mkdir()
        for name, rows in tables.items():
            if rows:
                write_csv(rows, tmp / "tables" / f"{name}.csv")
        (tmp / "results.json").write_text(json.dumps(_jsonable(results), indent=1))
        (tmp / "results.md").write_text(results_markdown(results))
        from tracesynth.report import write_report

        write_report(results, tmp / "report.html")
    console.print(f"pipeline: {timings['total_s']:.0f} s; report: {out_dir / 'report.html'}")
    return out_dir / "report.html"


def results_markdown(results: Mapping[str, Any]) -> str:
    """The summary tables as Markdown (what the README's results table is cut from)."""
    t = results["tables"]
    parts = [f"# Results: {results['config'].get('name', 'pipeline')}\n"]
    for n in results.get("notes", []):
        parts.append(f"- note: {n}\n")
    if t["regimes_summary"]:
        parts.append("\n## Next-event prediction (Macro-F1 on held-out real data, mean ± std over seeds)\n\n")
        parts.append(
            markdown_table(
                _mean_std_cols(t["regimes_summary"], ["workload", "regime", "generator"], ["macro_f1", "accuracy"])
            )
        )
    if t["discriminator_summary"]:
        parts.append(
            "\n## Discriminator two-sample test (AUC; 0.5 = indistinguishable from real)\n\n"
            "`auc`: synthetic vs real windows of the period the generator learned from; `auc_reference`: real vs "
            "real, two interleaved sets of small time blocks of that same period, same classifier and budget. "
            "A sample is as good as real data where its `auc` reaches `auc_reference`.\n\n"
        )
        parts.append(
            markdown_table(
                _mean_std_cols(
                    t["discriminator_summary"], ["workload", "generator", "variant"], ["auc", "auc_reference"]
                )
            )
        )
    if t["workload_id_summary"]:
        parts.append("\n## Workload identification (train on the named source, test on real)\n\n")
        parts.append(markdown_table(_mean_std_cols(t["workload_id_summary"], ["train_on"], ["macro_f1", "accuracy"])))
    if t["fidelity"]:
        parts.append("\n## Fidelity and privacy (against the real training block; lower is closer)\n\n")
        parts.append(markdown_table(t["fidelity"], FIDELITY_COLUMNS))
    if t["scarce_summary"]:
        parts.append("\n## Scarce-data curve (next-event Macro-F1)\n\n")
        parts.append(
            markdown_table(
                _mean_std_cols(t["scarce_summary"], ["workload", "budget", "generator", "synthetic_x"], ["macro_f1"])
            )
        )
    if t["generators"]:
        parts.append("\n## Generator cost\n\n")
        parts.append(markdown_table(t["generators"]))
    if t.get("sweep"):
        parts.append("\n## Sweep\n\n")
        values = [
            "macro_f1",
            "auc",
            "auc_reference",
            "jsd_3gram",
            "violation_rate_raw",
            "fit_s",
            "train_steps",
            "params",
        ]
        summ = ex.summarise(t["sweep"], ["workload", "variant"], values)
        parts.append(
            "`macro_f1`: next-event Macro-F1 on the held-out real block (rows `real`/`half_real`: real data alone; "
            "variants: half real + the variant's repaired sample, 50/50); `auc` / `auc_reference`: discriminator "
            "against the same-period real-vs-real reference; `violation_rate_raw`: before repair; `fit_s`, "
            "`train_steps`, `params`: compute cost.\n\n"
        )
        rows = [
            {"workload": r["workload"], "variant": r["variant"], "n": r["n"], **{v: _pm(r, v) for v in values}}
            for r in summ
        ]
        parts.append(markdown_table(rows, ["workload", "variant", *values, "n"]))
    tm = results.get("timings", {})
    parts.append("\n## Time\n\n" + ", ".join(f"{k} {v:.0f}" for k, v in tm.items()) + "\n")
    return "".join(parts)


def run_sweep(
    cfg: Mapping[str, Any],
    data: Mapping[str, ex.WorkloadData],
    ccfg: ClassifierConfig,
    seeds: Sequence[int],
    st: _Stages,
    note: Any,
) -> list[dict[str, Any]]:
    """Fit one generator per variant (config overrides), then score fidelity, discriminator AUC and
    next-event Macro-F1 of the 50/50 repaired mix; fit time and parameter count are the compute cost.
    Rows with variant "real" / "half_real" give the same classifier's Macro-F1 on real data alone."""
    sw = cfg["sweep"]
    base = dict(cfg["generators"][sw["generator"]])
    rows = []
    task = st.stage(f"sweep {sw.get('name', '')}", len(data) * len(sw["variants"]))
    for wl, wd in data.items():
        ref_cache: dict[tuple[int, ...], float] = {}  # one real-vs-real reference per seed for all variants
        for r in ex.regime_rows(wd, {}, ccfg, seeds, int(cfg["max_train_windows"]), st.tick, ["real", "half_real"]):
            rows.append({"workload": wl, "variant": r["regime"], "seed": r["seed"], "macro_f1": r["macro_f1"]})
        for label, over in sw["variants"].items():
            spec = copy.deepcopy(base)
            if spec.get("kind") == "diffusion":
                spec["config"] = {**spec.get("config", {}), **over}
            else:
                spec.update(over)
            spec["name"] = label
            n = int(base.get("sample_events") or len(wd.split.train))
            try:
                s = ex.fit_and_sample(
                    spec, wd.split.train, n, seed=0, rules=wd.rules, fit_events=base.get("fit_events")
                )
            except TraceSynthError as exc:
                note(f"sweep {label} on {wl} failed: {exc}")
                st.p.advance(task)
                continue
            fids = ex.fidelity_rows(wd, {label: s})
            fid, fid_raw = fids[-1], fids[1]  # [reference, raw, repaired?]
            for seed in seeds:
                regime = "mix_repaired" if s.repaired is not None else "mix_unrepaired"
                reg = ex.regime_rows(wd, {label: s}, ccfg, [seed], int(cfg["max_train_windows"]), st.tick, [regime])
                auc = ex.discriminator_rows(
                    wd,
                    {label: s},
                    ccfg,
                    [seed],
                    int(cfg["discriminator"]["max_windows"]),
                    st.tick,
                    final_only=True,
                    ref_cache=ref_cache,
                )
                rows.append(
                    {
                        "workload": wl,
                        "variant": label,
                        "seed": seed,
                        "macro_f1": reg[0]["macro_f1"],
                        "auc": auc[-1]["auc"],  # the repaired sample's when there is one (final_only)
                        "auc_reference": auc[-1]["auc_reference"],
                        "jsd_3gram": fid["jsd_3gram"],
                        "violation_rate": fid["violation_rate"],
                        "violation_rate_raw": fid_raw["violation_rate"],
                        "fit_s": s.fit_s,
                        "sample_s": s.sample_s,
                        "params": s.params,
                        "train_steps": s.info.get("train_steps"),
                        "train_windows": s.info.get("train_windows"),
                    }
                )
            st.p.advance(task)
    return rows
