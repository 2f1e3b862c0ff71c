"""The experiments: training regimes, the scarce-data curve, workload identification, sweeps.

Each function takes prepared real data (a time split per workload) and generator specs, and
returns flat rows (one dict per measurement) that the pipeline writes to CSV / Markdown. Only the
data differs between regimes: same classifier, same optimisation-step budget, several seeds.

Generator specs are small dicts (from the JSON config), built by tracesynth.generators.make_generator:
    {"kind": "markov", "order": 4}
    {"kind": "diffusion", "config": {...GaussianDiffusionConfig fields...}}
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracesynth.constraints import repair_trace
from tracesynth.errors import TraceSynthError
from tracesynth.evaluate import metrics
from tracesynth.evaluate.classifier import ClassifierConfig
from tracesynth.evaluate.tasks import next_event_scores, same_phase_discriminator, workload_id_scores
from tracesynth.evaluate.windows import Split, Vocab, Windows, dedup, make_windows, recent, subsample
from tracesynth.generators import load_generator, make_generator
from tracesynth.trace import Trace

REGIMES = ("real", "half_real", "mix_unrepaired", "mix_repaired", "synthetic_only")


# -- generators ----------------------------------------------------------------------------------
@dataclass
class Synthetic:
    """What one generator produced for one workload: the raw sample and its repaired version."""

    generator: str
    raw: Trace
    repaired: Trace | None
    fit_s: float
    sample_s: float
    repair_s: float = 0.0
    params: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


def fit_and_sample(
    spec: Mapping[str, Any],
    train: Trace,
    n_events: int,
    seed: int,
    rules: Any = None,
    fit_events: int | None = None,
    workload: str | None = None,
) -> Synthetic:
    """Fit a generator on `train` (optionally only its most recent `fit_events`), sample, and repair
    the sample with `rules` (three separate steps, each timed). A spec with "load" (a saved model
    directory, e.g. the shipped `models/all`) is sampled as it is, not fitted: of `workload` where it
    is conditional."""
    if spec.get("load"):
        t0 = time.perf_counter()
        gen = load_generator(spec["load"])
        fit_trace = train  # the discriminator's real side; the model itself learned the period it records
        conditional = workload is not None and bool(getattr(gen, "workloads", None))
        t1 = time.perf_counter()
        raw = gen.sample(n_events, seed=seed, **({"workload": workload} if conditional else {}))
    else:
        gen = make_generator(spec)
        fit_trace = train if not fit_events or len(train) <= fit_events else train.slice(len(train) - fit_events)
        t0 = time.perf_counter()
        gen.fit([fit_trace])
        t1 = time.perf_counter()
        raw = gen.sample(n_events, seed=seed)
    t2 = time.perf_counter()
    repaired = None if rules is None else repair_trace(raw, rules, seed=seed)[0]
    repair_s = time.perf_counter() - t2 if rules is not None else 0.0
    info = {"fit_events": len(fit_trace), **gen.fit_info}  # fit_events: the real period the sample imitates
    return Synthetic(str(spec.get("name", gen.name)), raw, repaired, t1 - t0, t2 - t1, repair_s, gen.n_params, info)


# -- data for the classifier ---------------------------------------------------------------------
@dataclass
class WorkloadData:
    """A workload's real split, encoded once: vocabulary, real train/test windows."""

    name: str
    split: Split
    vocab: Vocab
    context: int
    test: Windows
    rules: Any = None

    def windows(self, trace: Trace, stride: int = 1) -> Windows:
        """De-duplicated windows of a trace, none identical to a test window."""
        return dedup(make_windows(trace, self.vocab, self.context, stride), exclude=self.test)


def prepare_workload(
    name: str, split: Split, context: int, max_test: int, vocab: Vocab | None = None, rules: Any = None
) -> WorkloadData:
    vocab = vocab or Vocab.from_traces([split.train])
    test = dedup(make_windows(split.test, vocab, context))
    test = subsample(test, max_test, np.random.default_rng(12345))  # the same test set for every regime
    return WorkloadData(name, split, vocab, context, test, rules)


def _mix(a: Windows, b: Windows) -> Windows:
    return Windows.concat([a, b])


def regime_rows(
    wd: WorkloadData,
    synth: Mapping[str, Synthetic],
    cfg: ClassifierConfig,
    seeds: Sequence[int],
    max_train: int,
    tick: Callable[[], None] | None = None,
    only: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Next-event Macro-F1 / accuracy per regime and seed on the real test block of one workload."""
    rows: list[dict[str, Any]] = []
    real_all = wd.windows(wd.split.train)
    real_half = wd.windows(recent(wd.split.train, 0.5))
    syn_w = {
        g: (wd.windows(s.raw), wd.windows(s.repaired) if s.repaired is not None else None) for g, s in synth.items()
    }
    V = len(wd.vocab)
    for seed in seeds:
        rng = np.random.default_rng(seed)
        half = subsample(real_half, max_train // 2, rng)
        plans: list[tuple[str, str, Windows]] = [
            ("real", "-", subsample(real_all, max_train, rng)),
            ("half_real", "-", half),
        ]
        for g, (raw, rep) in syn_w.items():
            plans.append(("mix_unrepaired", g, _mix(half, subsample(raw, len(half), rng))))
            if rep is not None:
                plans.append(("mix_repaired", g, _mix(half, subsample(rep, len(half), rng))))
            plans.append(("synthetic_only", g, subsample(rep if rep is not None else raw, max_train, rng)))
        for regime, g, w in plans:
            if only is not None and regime not in only:
                continue
            s = next_event_scores(w, wd.test, V, cfg, seed=seed, tick=tick)
            rows.append(
                {"workload": wd.name, "regime": regime, "generator": g, "seed": seed, "train_windows": len(w), **s}
            )
    return rows


def discriminator_rows(
    wd: WorkloadData,
    synth: Mapping[str, Synthetic],
    cfg: ClassifierConfig,
    seeds: Sequence[int],
    max_windows: int,
    tick: Callable[[], None] | None = None,
    final_only: bool = False,
    ref_cache: dict[tuple[int, ...], float] | None = None,
) -> list[dict[str, Any]]:
    """Real-vs-synthetic AUC per generator (raw and repaired), each next to a real-vs-real reference.

    Both come from the same phase: the real side is the period the generator was fitted on (the
    training block, or its most recent `fit_events`), dealt into interleaved time blocks
    (tasks.same_phase_discriminator), so "0.5 = indistinguishable" holds for the reference and the
    AUC of a sample reads against it. The held-out test block is not used here. `final_only` scores
    only the repaired sample (the raw one when there is none); `ref_cache` see same_phase_discriminator.
    """
    ctx = wd.context
    V = len(wd.vocab)
    periods: dict[int, dict[tuple[str, str], Trace]] = {}  # real period length -> samples fitted on it
    for g, s in synth.items():
        n = int(s.info.get("fit_events") or len(wd.split.train))
        if not (final_only and s.repaired is not None):
            periods.setdefault(n, {})[(g, "raw")] = s.raw
        if s.repaired is not None:
            periods.setdefault(n, {})[(g, "repaired")] = s.repaired
    rows = []
    for n_real, samples in periods.items():
        period = wd.split.train if n_real >= len(wd.split.train) else wd.split.train.slice(len(wd.split.train) - n_real)
        real = make_windows(period, wd.vocab, ctx)
        others = {f"{g}\t{v}": make_windows(tr, wd.vocab, ctx) for (g, v), tr in samples.items()}
        for seed in seeds:
            res = same_phase_discriminator(
                real, others, V, cfg, seed=seed, tick=tick, gap=ctx, max_windows=max_windows, ref_cache=ref_cache
            )
            for key in others:
                g, variant = key.split("\t")
                rows.append(
                    {
                        "workload": wd.name,
                        "generator": g,
                        "variant": variant,
                        "seed": seed,
                        "auc": res[key],
                        "auc_reference": res["reference"],
                        "real_events": len(period),
                        "windows_per_class": int(res["windows_fit"] + res["windows_score"]),
                    }
                )
    return rows


def fidelity_rows(wd: WorkloadData, synth: Mapping[str, Synthetic], window: int = 128) -> list[dict[str, Any]]:
    """Fidelity, violations and memorisation of each sample against the real training block.

    A reference row scores the real test block the same way: the level a perfect generator
    (another stretch of real trace) would reach.
    """
    train = wd.split.train
    items: list[tuple[str, str, Trace]] = [("real (test block)", "reference", wd.split.test)]
    for g, s in synth.items():
        items.append((g, "raw", s.raw))
        if s.repaired is not None:
            items.append((g, "repaired", s.repaired))
    rows = []
    for g, variant, tr in items:
        row: dict[str, Any] = {"workload": wd.name, "generator": g, "variant": variant, "events": len(tr)}
        row.update(metrics.fidelity(train, tr))
        row["violation_rate"] = metrics.violation_rate(tr, wd.rules)
        row.update(metrics.memorisation(tr, train, window))
        rows.append(row)
    return rows


def workload_id_rows(
    data: Mapping[str, WorkloadData],
    vocab: Vocab,
    synth: Mapping[str, Mapping[str, Synthetic]],
    cfg: ClassifierConfig,
    seeds: Sequence[int],
    per_class: int,
    tick: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Workload identification: train on real (reference) or on one generator's samples, test on real.

    `data` must be encoded with the shared vocabulary `vocab`; `synth[workload][generator]`.
    """
    names = sorted(data)
    test = {n: data[n].test for n in names}
    sources: dict[str, dict[str, Windows]] = {"real": {n: data[n].windows(data[n].split.train) for n in names}}
    gens = sorted({g for n in names for g in synth.get(n, {})})
    for g in gens:
        if all(g in synth.get(n, {}) for n in names):
            sources[g] = {}
            for n in names:
                s = synth[n][g]
                sources[g][n] = data[n].windows(s.repaired if s.repaired is not None else s.raw)
    rows = []
    for seed in seeds:
        for src, train in sources.items():
            sc = workload_id_scores(train, test, len(vocab), cfg, seed=seed, tick=tick, per_class=per_class)
            rows.append({"train_on": src, "seed": seed, **sc})
    return rows


def scarce_rows(
    wd: WorkloadData,
    specs: Mapping[str, Mapping[str, Any]],
    budgets: Sequence[float],
    multipliers: Sequence[int],
    cfg: ClassifierConfig,
    seeds: Sequence[int],
    max_train: int,
    tick: Callable[[], None] | None = None,
    on_skip: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Scarce-data curve: the most recent `budget` of real training data alone, and with synthetic data
    from a generator fitted on that same budget only (m x as many synthetic events as real)."""
    rows = []
    V = len(wd.vocab)
    for b in budgets:
        real_tr = recent(wd.split.train, b)
        real_w = wd.windows(real_tr)
        if len(real_w) < 8:
            if on_skip:
                on_skip(f"scarce {wd.name} {b:.0%}: only {len(real_w)} windows")
            continue
        samples: dict[str, dict[int, Windows]] = {}
        for g, spec in specs.items():
            if spec.get("load"):  # a trained model learned far more than the budget: not a scarce-data point
                continue
            try:
                s = fit_and_sample(spec, real_tr, len(real_tr) * max(multipliers), seed=0, rules=wd.rules)
            except TraceSynthError as exc:  # e.g. a budget shorter than the model's context
                if on_skip:
                    on_skip(f"scarce {wd.name} {b:.0%} {g}: {exc}")
                continue
            src = s.repaired if s.repaired is not None else s.raw
            samples[g] = {m: wd.windows(src.slice(0, len(real_tr) * m)) for m in multipliers}
        for seed in seeds:
            rng = np.random.default_rng(seed)
            rw = subsample(real_w, max_train, rng)
            sc = next_event_scores(rw, wd.test, V, cfg, seed=seed, tick=tick)
            base = {"workload": wd.name, "budget": b, "real_events": len(real_tr), "seed": seed}
            rows.append({**base, "generator": "-", "synthetic_x": 0, "train_windows": len(rw), **sc})
            for g, by_m in samples.items():
                for m, sw in by_m.items():
                    w = _mix(rw, subsample(sw, len(rw) * m, rng))
                    sc = next_event_scores(w, wd.test, V, cfg, seed=seed, tick=tick)
                    rows.append({**base, "generator": g, "synthetic_x": m, "train_windows": len(w), **sc})
    return rows


# -- summaries -----------------------------------------------------------------------------------
def summarise(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], values: Sequence[str]) -> list[dict[str, Any]]:
    """Mean and spread (std over seeds) of `values`, grouped by `keys`, in first-seen order."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for k, rs in groups.items():
        row: dict[str, Any] = dict(zip(keys, k, strict=True))
        row["n"] = len(rs)
        for v in values:
            xs = np.asarray([r[v] for r in rs if r.get(v) is not None], dtype=float)
            xs = xs[~np.isnan(xs)]
            row[v] = float(xs.mean()) if len(xs) else math.nan
            row[f"{v}_std"] = float(xs.std(ddof=1)) if len(xs) > 1 else 0.0
        out.append(row)
    return out
