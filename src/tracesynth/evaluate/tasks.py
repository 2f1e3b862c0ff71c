"""Downstream tasks, all scored with the same classifier (tracesynth.evaluate.classifier).

- next-event prediction: given the previous events, predict the type of the next; Macro-F1 and
  accuracy on windows of the held-out REAL test block;
- discriminator two-sample test: AUC of the classifier telling real from synthetic windows
  (0.5 = indistinguishable, 1.0 = always told apart);
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
