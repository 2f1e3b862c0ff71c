"""Downstream tasks, all scored with the same classifier (tracesynth.evaluate.classifier).

- next-event prediction: given the previous events, predict the type of the next; Macro-F1 and
  accuracy on windows of the held-out REAL test block;
- discriminator two-sample test: AUC of the classifier telling real from synthetic windows
  (0.5 = indistinguishable, 1.0 = always told apart), each with a real-vs-real reference drawn from
  the same phase of the trace (`same_phase_discriminator`);
- workload identification: which workload a window comes from, trained on windows of one source
  (e.g. synthetic only) and scored on real test windows of every workload.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from sklearn.metrics import accuracy_score, f1_score, roc_auc_score

from tracesynth.errors import TraceSynthError
from tracesynth.evaluate.classifier import ClassifierConfig, predict_proba, train_classifier
from tracesynth.evaluate.windows import Windows

Tick = Callable[[], None] | None


def next_event_scores(
    train: Windows, test: Windows, n_events: int, cfg: ClassifierConfig, seed: int = 0, tick: Tick = None
) -> dict[str, float]:
    """Train next-event prediction on `train`, score Macro-F1 / accuracy on `test` (real windows)."""
    if not len(train) or not len(test):
        raise TraceSynthError("next-event task: no training or test windows")
    model = train_classifier(train, train.labels, n_events, n_events, cfg, seed=seed, progress=tick)
    pred = predict_proba(model, test, cfg).argmax(1)
    return {
        "macro_f1": float(f1_score(test.labels, pred, average="macro", zero_division=0)),
        "accuracy": float(accuracy_score(test.labels, pred)),
    }


def _halves(w: Windows, frac: float, gap: int) -> tuple[Windows, Windows]:
    """Contiguous first/last parts with a gap, so overlapping windows never straddle train and test."""
    n = len(w)
    cut = int(n * frac)
    return w.take(np.arange(0, max(cut - gap, 1))), w.take(np.arange(min(cut + gap, n - 1), n))


def discriminator_auc(
    real: Windows,
    synth: Windows,
    n_events: int,
    cfg: ClassifierConfig,
    seed: int = 0,
    tick: Tick = None,
    gap: int = 0,
) -> float:
    """AUC of telling real (label 1) from synthetic (label 0) windows, on held-out parts of both.

    Each side is cut into a contiguous 70% (training) and 30% (scoring) part; pass `gap` = window
    length when the windows were cut at stride 1 so no scored window overlaps a trained one.
    """
    n = min(len(real), len(synth))
    if n < 20:
        raise TraceSynthError(f"discriminator: too few windows ({len(real)} real, {len(synth)} synthetic)")
    r_tr, r_te = _halves(real.take(np.arange(len(real) - n, len(real))), 0.7, gap)
    s_tr, s_te = _halves(synth.take(np.arange(n)), 0.7, gap)
    train = Windows.concat([r_tr, s_tr])
    y = np.concatenate([np.ones(len(r_tr), np.int64), np.zeros(len(s_tr), np.int64)])
    model = train_classifier(train, y, n_events, 2, cfg, seed=seed, progress=tick)
    test = Windows.concat([r_te, s_te])
    yt = np.concatenate([np.ones(len(r_te)), np.zeros(len(s_te))])
    score = predict_proba(model, test, cfg)[:, 1]
    return float(roc_auc_score(yt, score))


def interleaved_roles(n: int, block: int, gap: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """Indices of `n` stride-1 windows (in time order) dealt into `k` roles by small interleaved time blocks.

    Consecutive blocks of `block` windows form cycles of k blocks; each cycle hands its blocks to the k
    roles in a seeded random order, so every role spans the whole period (the same mix of phases) and
    no role systematically precedes another. The last `gap` windows of every block are dropped: with
    gap = the window length, no two windows of different blocks share an event (nor a label).
    """
    if block <= gap:
        raise TraceSynthError(f"discriminator: block ({block} windows) must exceed the gap ({gap})")
    rng = np.random.default_rng(seed)
    starts = np.arange(0, n, block)
    owner = np.concatenate([rng.permutation(k) for _ in range(-(-len(starts) // k))])[: len(starts)]
    roles: list[list[np.ndarray]] = [[] for _ in range(k)]
    for s0, r in zip(starts, owner, strict=True):
        roles[r].append(np.arange(s0, min(s0 + block - gap, n)))
    return [np.concatenate(r) if r else np.zeros(0, np.int64) for r in roles]


def _pick(idx: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n indices drawn without replacement, kept in time order (spread over the whole role)."""
    return idx if len(idx) <= n else np.sort(rng.choice(idx, n, replace=False))


def _auc(
    fit: tuple[Windows, Windows],
    score: tuple[Windows, Windows],
    n_events: int,
    cfg: ClassifierConfig,
    seed: int,
    tick: Tick,
) -> float:
    """Train on fit = (label-1 windows, label-0 windows), return the AUC on score = (label 1, label 0)."""
    x = Windows.concat(list(fit))
    y = np.concatenate([np.ones(len(fit[0]), np.int64), np.zeros(len(fit[1]), np.int64)])
    model = train_classifier(x, y, n_events, 2, cfg, seed=seed, progress=tick)
    yt = np.concatenate([np.ones(len(score[0])), np.zeros(len(score[1]))])
    return float(roc_auc_score(yt, predict_proba(model, Windows.concat(list(score)), cfg)[:, 1]))


def same_phase_discriminator(
    real: Windows,
    others: Mapping[str, Windows],
    n_events: int,
    cfg: ClassifierConfig,
    seed: int = 0,
    tick: Tick = None,
    gap: int = 128,
    block: int | None = None,
    max_windows: int = 3000,
    ref_cache: dict[tuple[int, ...], float] | None = None,
) -> dict[str, float]:
    """Discriminator AUC of each synthetic source against real windows of one period, plus a real-vs-real
    reference from that same period, all with the same classifier, budget and window counts.

    `real`: stride-1 windows, in time order, of the real period the generators learned from;
    `others`: stride-1 windows of each synthetic sample. The real windows are dealt into four roles by
    interleaved time blocks (A-fit, B-fit, A-score, B-score), each synthetic sample into two (fit,
    score). The reference trains on A-fit vs B-fit and scores A-score vs B-score: two real samples of
    the same phase mix, so it sits near 0.5 unless the period itself is too short or too bursty to
    give two alike samples. Each source S trains on A-fit vs S-fit and scores A-score vs S-score.
    `ref_cache` (a dict kept across calls on the same `real`) reuses the reference of an earlier call
    with the same seed and window counts, e.g. across the variants of a sweep.
    Returns {"reference": auc, name: auc, ..., "windows_fit": n, "windows_score": n} (n per class).
    """
    block = block or 4 * gap
    rng = np.random.default_rng(seed)
    a_fit, b_fit, a_sc, b_sc = interleaved_roles(len(real), block, gap, 4, seed)
    parts = {g: interleaved_roles(len(w), block, gap, 2, seed) for g, w in others.items()}
    # one window count for every comparison, so the reference and each source get the same budget
    n_fit = min([len(a_fit), len(b_fit), max_windows // 2] + [len(p[0]) for p in parts.values()])
    n_sc = min([len(a_sc), len(b_sc), max_windows // 2] + [len(p[1]) for p in parts.values()])
    if min(n_fit, n_sc) < 10:
        raise TraceSynthError(
            f"discriminator: too few windows per role ({n_fit} to fit, {n_sc} to score); "
            "the real period or a synthetic sample is too short for its block size"
        )
    ra, rs = real.take(_pick(a_fit, n_fit, rng)), real.take(_pick(a_sc, n_sc, rng))
    rb, rbs = real.take(_pick(b_fit, n_fit, rng)), real.take(_pick(b_sc, n_sc, rng))
    key = (len(real), seed, n_fit, n_sc)
    if ref_cache is not None and key in ref_cache:
        out = {"reference": ref_cache[key]}
    else:
        out = {"reference": _auc((ra, rb), (rs, rbs), n_events, cfg, seed, tick)}
        if ref_cache is not None:
            ref_cache[key] = out["reference"]
    for g, w in others.items():
        fit, sc = parts[g]
        out[g] = _auc(
            (ra, w.take(_pick(fit, n_fit, rng))), (rs, w.take(_pick(sc, n_sc, rng))), n_events, cfg, seed, tick
        )
    out["windows_fit"], out["windows_score"] = float(n_fit), float(n_sc)
    return out


def workload_id_scores(
    train: Mapping[str, Windows],
    test: Mapping[str, Windows],
    n_events: int,
    cfg: ClassifierConfig,
    seed: int = 0,
    tick: Tick = None,
    per_class: int | None = None,
) -> dict[str, float]:
    """Learn the workload of a window from `train` (one Windows per workload), score on real `test`."""
    names = sorted(test)
    if sorted(train) != names or len(names) < 2:
        raise TraceSynthError("workload identification needs the same >= 2 workloads in train and test")
    rng = np.random.default_rng(seed)
    parts, ys = [], []
    for i, name in enumerate(names):
        w = train[name]
        if per_class is not None and len(w) > per_class:
            w = w.take(np.sort(rng.choice(len(w), per_class, replace=False)))
        parts.append(w)
        ys.append(np.full(len(w), i, np.int64))
    model = train_classifier(Windows.concat(parts), np.concatenate(ys), n_events, len(names), cfg, seed, tick)
    tw = Windows.concat([test[n] for n in names])
    yt = np.concatenate([np.full(len(test[n]), i) for i, n in enumerate(names)])
    pred = predict_proba(model, tw, cfg).argmax(1)
    return {
        "macro_f1": float(f1_score(yt, pred, average="macro", zero_division=0)),
        "accuracy": float(accuracy_score(yt, pred)),
    }
