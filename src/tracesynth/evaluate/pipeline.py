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
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from atomicio import atomic_path
from tracesynth.constraints import mine_rules
from tracesynth.errors import TraceSynthError
from tracesynth.evaluate import experiments as ex
from tracesynth.evaluate.classifier import ClassifierConfig
from tracesynth.evaluate.plots import plot_data
from tracesynth.evaluate.windows import Vocab, split_trace
from tracesynth.generators import make_generator, saved_kind
from tracesynth.jsonable import jsonable
from tracesynth.report import SWEEP_VALUES, results_markdown, write_report
from tracesynth.tables import cell, columns
from tracesynth.trace import Trace

DEFAULTS: dict[str, Any] = {
    "name": "pipeline",
    "comment": None,  # free text (e.g. what an experiment config cut to fit its time budget)
    "traces": None,  # list of paths or {"path", "workload"}; None: the shipped dataset (data/)
    # start_fraction: the slice begins after this share of each trace's events (0.7: the part the shipped
    # checkpoint models/all never saw), then skip_events more
    "data": {"dir": "data", "workloads": None, "max_events": 60000, "skip_events": 0, "start_fraction": 0.0},
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
    "sweep": None,  # {"name", "generator": name or [names], "variants": {label: {config overrides}}}
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


def resolve_path(p: str | Path, base: str) -> Path:
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
    """workload name -> real trace (one contiguous slice of at most data.max_events events, from
    data.start_fraction of the trace's events plus data.skip_events on)."""
    from tracesynth.io import read_trace

    entries: list[tuple[Path, str | None]] = []
    if cfg.get("traces"):
        for e in cfg["traces"]:
            if isinstance(e, Mapping):
                entries.append((resolve_path(e["path"], cfg["_base"]), e.get("workload")))
            else:
                entries.append((resolve_path(e, cfg["_base"]), None))
    else:
        d = resolve_path(cfg["data"]["dir"], cfg["_base"])
        manifest = d / "manifest.json"
        if manifest.is_file():
            entries = _manifest_entries(manifest)
        if not entries:
            entries = [(p, None) for p in sorted(d.glob("*.parquet"))]
        if not entries:
            raise TraceSynthError("no traces: the dataset directory holds no manifest.json or *.parquet", d)
    want = cfg["data"].get("workloads")
    skip, cap = int(cfg["data"].get("skip_events") or 0), cfg["data"].get("max_events")
    start = float(cfg["data"].get("start_fraction") or 0.0)
    if not 0.0 <= start < 1.0:
        raise TraceSynthError(f"data.start_fraction must be in [0, 1), got {start}")
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
        first = min(len(trace), int(round(start * len(trace))) + skip)
        stop = len(trace) if not cap else min(len(trace), first + int(cap))
        out[name] = trace.slice(first, stop)
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
OUTPUTS = ("tables", "results.json", "results.md", "report.html")


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Rows as CSV, floats to 4 significant digits (tables.cell), None as an empty field."""
    cols = columns(rows)
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: cell(r.get(k)) if isinstance(r.get(k), float) else r.get(k) for k in cols})


def write_outputs(results: Mapping[str, Any], out_dir: Path) -> Path:
    """tables/*.csv, results.json, results.md and report.html, all in place or none."""
    with atomic_path(out_dir, directory=True, contents=OUTPUTS) as tmp:
        (tmp / "tables").mkdir()
        for name, rows in results["tables"].items():
            if rows:
                write_csv(rows, tmp / "tables" / f"{name}.csv")
        (tmp / "results.json").write_text(json.dumps(jsonable(results), indent=1))
        (tmp / "results.md").write_text(results_markdown(results))
        write_report(results, tmp / "report.html")
    return out_dir / "report.html"


# -- the pipeline ---------------------------------------------------------------------------------
@dataclass
class _Run:
    """One run's shared state: its config, the progress display, the notes and the stage timings."""

    cfg: dict[str, Any]
    console: Console
    progress: Progress | None = None
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _cls_task: Any = None

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        self.console.print(f"[yellow]note:[/] {msg}", highlight=False)

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.timings[key] = time.perf_counter() - t0

    def stage(self, desc: str, total: int) -> Any:
        """A new overall bar; logs and CI (no terminal) get one line per stage instead."""
        assert self.progress is not None
        if not self.progress.console.is_terminal:
            self.progress.console.print(f"{time.strftime('%H:%M:%S')} {desc} ({total})", highlight=False)
        return self.progress.add_task(desc, total=total)

    def advance(self, task: Any) -> None:
        assert self.progress is not None
        self.progress.advance(task)

    def describe(self, task: Any, description: str) -> None:
        assert self.progress is not None
        self.progress.update(task, description=description)

    def tick(self) -> None:
        """One classifier optimisation step (its own bar, shown from the first classifier stage on)."""
        assert self.progress is not None
        if self._cls_task is None:
            self._cls_task = self.progress.add_task("classifier steps", total=None)
        self.progress.advance(self._cls_task)

    def seeds(self, task: str | None = None) -> list[int]:
        """A task's own seeds when its section names them, else the global ones."""
        own = self.cfg[task].get("seeds") if task else None
        return [int(s) for s in (own or self.cfg["seeds"])]


def run_pipeline(config: str | Path | Mapping[str, Any], out_dir: str | Path, console: Console | None = None) -> Path:
    """Run train -> sample -> repair -> evaluate -> report; returns the path of report.html."""
    cfg = load_config(config)
    console = console or Console(stderr=True)
    import torch

    threads = torch.get_num_threads()
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    try:
        return _run(cfg, Path(out_dir), console)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: dict[str, Any], out_dir: Path, console: Console) -> Path:
    t_start = time.perf_counter()
    run = _Run(cfg, console)
    specs = generator_specs(cfg)
    with run.timed("load_s"):
        sources = load_sources(cfg)
    console.print(
        "pipeline: "
        + ", ".join(f"{k} ({len(v):,} events)" for k, v in sources.items())
        + f"; generators: {', '.join(specs)}"
    )
    bars = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*bars, console=console, transient=False) as progress:
        run.progress = progress
        with run.timed("generate_s"):
            data, synth, gen_rows, plots = generate(run, sources, specs)
        with run.timed("metrics_s"):
            rows = {"generators": gen_rows, "fidelity": fidelity(run, data, synth)}
        rows.update(classifier_tasks(run, data, synth, specs))
    run.timings["total_s"] = time.perf_counter() - t_start
    results = {
        "config": {k: v for k, v in cfg.items() if k != "_base"},
        "notes": run.notes,
        "tables": summarise_tables(rows),
        "timings": run.timings,
        "plots": plots,
        "generators": list(specs),
    }
    report = write_outputs(results, out_dir)
    console.print(f"pipeline: {run.timings['total_s']:.0f} s; report: {report}")
    return report


def generator_specs(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The config's generators by name, each checked by building it (an unknown kind, a bad config or
    a missing optional dependency fails here, before any work), plus the regimes it names."""
    bad = sorted(set(cfg["regimes"].get("only") or []) - set(ex.REGIMES))
    if bad:
        raise TraceSynthError(f"unknown regime(s) {', '.join(bad)} in regimes.only (known: {', '.join(ex.REGIMES)})")
    specs = {name: dict(spec, name=name) for name, spec in cfg["generators"].items()}
    if not specs:
        raise TraceSynthError("no generator to evaluate (the config's generators is empty)")
    for spec in specs.values():
        make_generator(spec)
        if spec.get("load"):  # a trained model (e.g. the shipped models/all), sampled without fitting
            spec["load"] = str(resolve_path(spec["load"], cfg["_base"]))
            kind = saved_kind(spec["load"])
            if kind.name != spec.get("kind"):
                raise TraceSynthError(f"generator {spec['name']}: the model saved there is of kind {kind.name}, "
                                      f"not {spec.get('kind')}", Path(spec["load"]))
    return specs


Samples = Mapping[str, Mapping[str, ex.Synthetic]]  # workload -> generator -> its sample
Generated = tuple[dict[str, ex.WorkloadData], dict[str, dict[str, ex.Synthetic]], list[dict[str, Any]], dict[str, Any]]


def generate(run: _Run, sources: Mapping[str, Trace], specs: Mapping[str, Mapping[str, Any]]) -> Generated:
    """Per workload: time split, rules mined on the training block, then every generator fitted,
    sampled and its sample repaired. Returns the prepared data, the samples, their cost rows and the
    plot data."""
    cfg, ctx = run.cfg, int(run.cfg["context"])
    data: dict[str, ex.WorkloadData] = {}
    synth: dict[str, dict[str, ex.Synthetic]] = {}
    rows: list[dict[str, Any]] = []
    plots: dict[str, Any] = {}
    swept = swept_generators(cfg)  # the sweep fits each of its variants
    task = run.stage("fit + sample + repair", len(sources) * len(specs))
    for wl, trace in sources.items():
        split = split_trace(trace, cfg["split"])
        rules = mine_rules([split.train]) if cfg["repair"] else None
        data[wl] = ex.prepare_workload(wl, split, ctx, int(cfg["max_test_windows"]), rules=rules)
        synth[wl] = {}
        n_sample = max(ctx * 4, int(len(split.train) * float(cfg["sample_factor"])))
        for g, spec in specs.items():
            if g in swept:
                run.advance(task)
                continue
            run.describe(task, f"fit + sample + repair: {g} on {wl}")
            n = int(spec.get("sample_events") or n_sample)
            try:
                s = ex.fit_and_sample(spec, split.train, n, seed=0, rules=rules, fit_events=spec.get("fit_events"),
                                      workload=wl)
            except TraceSynthError as exc:  # e.g. a workload shorter than the model's context
                run.note(f"{g} on {wl} failed: {exc}")
                run.advance(task)
                continue
            synth[wl][g] = s
            rows.append(
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
            run.advance(task)
        plots[wl] = plot_data(
            split.train,
            {g: s.raw for g, s in synth[wl].items()},
            {g: s.repaired for g, s in synth[wl].items() if s.repaired is not None},
        )
    return data, synth, rows, plots


def fidelity(run: _Run, data: Mapping[str, ex.WorkloadData], synth: Samples) -> list[dict[str, Any]]:
    """Fidelity, violations and memorisation of every sample (and of the real test block)."""
    rows: list[dict[str, Any]] = []
    task = run.stage("fidelity + privacy metrics", len(data))
    for wl, wd in data.items():
        rows += ex.fidelity_rows(wd, synth[wl], int(run.cfg["context"]))
        run.advance(task)
    return rows


def classifier_tasks(
    run: _Run, data: Mapping[str, ex.WorkloadData], synth: Samples, specs: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """The enabled classifier experiments, each a timed stage with its rows under its own name."""
    cfg = run.cfg
    ccfg = ClassifierConfig(**cfg["classifier"])
    stages: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "discriminator": lambda: discriminator_stage(run, data, synth, ccfg),
        "regimes": lambda: regimes_stage(run, data, synth, ccfg),
        "workload_id": lambda: workload_id_stage(run, data, synth, ccfg),
        "scarce": lambda: scarce_stage(run, data, specs, ccfg),
        "sweep": lambda: run_sweep(run, data, ccfg),
    }
    enabled = {
        "discriminator": cfg["discriminator"]["enabled"],
        "regimes": cfg["regimes"]["enabled"],
        "workload_id": cfg["workload_id"]["enabled"] and len(data) >= 2,  # needs two workloads to tell apart
        "scarce": cfg["scarce"]["enabled"],
        "sweep": bool(cfg.get("sweep")),
    }
    rows = {}
    for name, stage in stages.items():
        if enabled[name]:
            with run.timed(f"{name}_s"):
                rows[name] = stage()
    return rows


def _chosen(run: _Run, section: str, data: Mapping[str, ex.WorkloadData]) -> list[str]:
    """The workloads a section names (all by default) that the run has."""
    return [w for w in (run.cfg[section]["workloads"] or list(data)) if w in data]


def discriminator_stage(
    run: _Run, data: Mapping[str, ex.WorkloadData], synth: Samples, ccfg: ClassifierConfig
) -> list[dict[str, Any]]:
    seeds, max_windows = run.seeds("discriminator"), int(run.cfg["discriminator"]["max_windows"])
    return _per_workload(
        run,
        "discriminator (real vs synthetic)",
        list(data),
        lambda wl: ex.discriminator_rows(data[wl], synth[wl], ccfg, seeds, max_windows, run.tick),
    )


def regimes_stage(
    run: _Run, data: Mapping[str, ex.WorkloadData], synth: Samples, ccfg: ClassifierConfig
) -> list[dict[str, Any]]:
    seeds, max_train, only = run.seeds("regimes"), int(run.cfg["max_train_windows"]), run.cfg["regimes"].get("only")
    return _per_workload(
        run,
        "next-event regimes",
        _chosen(run, "regimes", data),
        lambda wl: ex.regime_rows(data[wl], synth[wl], ccfg, seeds, max_train, run.tick, only),
    )


def workload_id_stage(
    run: _Run, data: Mapping[str, ex.WorkloadData], synth: Samples, ccfg: ClassifierConfig
) -> list[dict[str, Any]]:
    """All workloads re-encoded in one shared vocabulary, then one classifier per training source."""
    cfg = run.cfg
    task = run.stage("workload identification", 1)
    vocab = Vocab.from_traces([wd.split.train for wd in data.values()])
    ctx, max_test = int(cfg["context"]), int(cfg["max_test_windows"])
    shared = {
        wl: ex.prepare_workload(wl, wd.split, ctx, max_test, vocab=vocab, rules=wd.rules) for wl, wd in data.items()
    }
    per_class = int(cfg["workload_id"]["per_class"])
    rows = ex.workload_id_rows(shared, vocab, synth, ccfg, run.seeds("workload_id"), per_class, run.tick)
    run.advance(task)
    return rows


def scarce_stage(
    run: _Run, data: Mapping[str, ex.WorkloadData], specs: Mapping[str, Mapping[str, Any]], ccfg: ClassifierConfig
) -> list[dict[str, Any]]:
    sc, seeds, max_train = run.cfg["scarce"], run.seeds("scarce"), int(run.cfg["max_train_windows"])
    return _per_workload(
        run,
        "scarce-data curve",
        _chosen(run, "scarce", data),
        lambda wl: ex.scarce_rows(
            data[wl], specs, sc["budgets"], sc["multipliers"], ccfg, seeds, max_train, run.tick, run.note
        ),
    )


def _per_workload(
    run: _Run, desc: str, workloads: Sequence[str], rows_of: Callable[[str], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One stage bar over `workloads`, concatenating each workload's rows."""
    task = run.stage(desc, len(workloads))
    rows: list[dict[str, Any]] = []
    for wl in workloads:
        rows += rows_of(wl)
        run.advance(task)
    return rows


# Summary tables: (raw table, group-by keys, values), mean and std over seeds.
SUMMARIES = {
    "discriminator_summary": ("discriminator", ["workload", "generator", "variant"], ["auc", "auc_reference"]),
    "regimes_summary": ("regimes", ["workload", "regime", "generator"], ["macro_f1", "accuracy"]),
    "workload_id_summary": ("workload_id", ["train_on"], ["macro_f1", "accuracy"]),
    "scarce_summary": ("scarce", ["workload", "budget", "generator", "synthetic_x"], ["macro_f1", "accuracy"]),
    "sweep_summary": ("sweep", ["workload", "variant"], list(SWEEP_VALUES)),
}
TABLES = ("generators", "fidelity", "discriminator", "regimes", "workload_id", "scarce", "sweep")


def summarise_tables(rows: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every raw table (empty where its stage did not run) and its summary next to it."""
    tables = {name: rows.get(name, []) for name in TABLES}
    for name, (raw, keys, values) in SUMMARIES.items():
        tables[name] = ex.summarise(tables[raw], keys, values)
    order = [n for t in TABLES for n in (t, f"{t}_summary") if n in tables]
    return {n: tables[n] for n in order}


def swept_generators(cfg: Mapping[str, Any]) -> list[str]:
    """The generators a config's sweep varies (its "generator": one name or a list)."""
    if not cfg.get("sweep"):
        return []
    g = cfg["sweep"]["generator"]
    return [g] if isinstance(g, str) else list(g)


def run_sweep(run: _Run, data: Mapping[str, ex.WorkloadData], ccfg: ClassifierConfig) -> list[dict[str, Any]]:
    """Fit one generator per variant (config overrides) of each swept generator, then score fidelity,
    discriminator AUC and next-event Macro-F1 of the 50/50 repaired mix; fit time and parameter count are the
    compute cost. Rows with variant "real" / "half_real" give the same classifier's Macro-F1 on real data
    alone. With several swept generators a variant is named "generator:label"."""
    cfg = run.cfg
    seeds = run.seeds()
    sw = cfg["sweep"]
    gens = swept_generators(cfg)
    variants = [(g, label, over) for g in gens for label, over in sw["variants"].items()]
    max_train, max_disc = int(cfg["max_train_windows"]), int(cfg["discriminator"]["max_windows"])
    rows = []
    task = run.stage(f"sweep {sw.get('name', '')}", len(data) * len(variants))
    for wl, wd in data.items():
        ref_cache: dict[tuple[int, ...], float] = {}  # one real-vs-real reference per seed for all variants
        for r in ex.regime_rows(wd, {}, ccfg, seeds, max_train, run.tick, ["real", "half_real"]):
            rows.append({"workload": wl, "variant": r["regime"], "seed": r["seed"], "macro_f1": r["macro_f1"]})
        for g, label, over in variants:
            base = dict(cfg["generators"][g])
            spec = copy.deepcopy(base)
            if "config" in spec:  # a network's settings (diffusion, masked, ar) live in its config
                spec["config"] = {**spec["config"], **over}
            else:
                spec.update(over)
            label = label if len(gens) == 1 else f"{g}:{label}"
            spec["name"] = label
            n = int(base.get("sample_events") or len(wd.split.train))
            try:
                s = ex.fit_and_sample(
                    spec, wd.split.train, n, seed=0, rules=wd.rules, fit_events=base.get("fit_events")
                )
            except TraceSynthError as exc:
                run.note(f"sweep {label} on {wl} failed: {exc}")
                run.advance(task)
                continue
            fids = ex.fidelity_rows(wd, {label: s})
            fid, fid_raw = fids[-1], fids[1]  # [reference, raw, repaired?]
            regime = "mix_repaired" if s.repaired is not None else "mix_unrepaired"
            for seed in seeds:
                reg = ex.regime_rows(wd, {label: s}, ccfg, [seed], max_train, run.tick, [regime])
                auc = ex.discriminator_rows(
                    wd, {label: s}, ccfg, [seed], max_disc, run.tick, final_only=True, ref_cache=ref_cache
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
            run.advance(task)
    return rows
