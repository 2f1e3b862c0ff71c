"""The one small classifier every regime and task uses (only the data differs between regimes).

A GRU over (event type, dt bin) embeddings; its last hidden state predicts a class (the next event
type, real-vs-synthetic, or the workload). Trained for a fixed number of optimisation steps with a
fixed batch size, so every regime gets the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tracesynth.evaluate.windows import N_DT_BINS, Windows


@dataclass
class ClassifierConfig:
    embed: int = 32
    hidden: int = 64
    steps: int = 300
    batch: int = 64
    lr: float = 3e-3
    context: int | None = None  # use only the last `context` events of each window (None: all)


class SeqClassifier(nn.Module):
    def __init__(self, n_events: int, n_out: int, cfg: ClassifierConfig):
        super().__init__()
        self.ev = nn.Embedding(n_events, cfg.embed)
        self.dt = nn.Embedding(N_DT_BINS, cfg.embed)
        self.gru = nn.GRU(cfg.embed, cfg.hidden, batch_first=True)
        self.head = nn.Linear(cfg.hidden, n_out)

    def forward(self, ev: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(self.ev(ev) + self.dt(dt))
        return self.head(h[-1])


def _inputs(w: Windows, context: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    ev, dt = w.events, w.dts
    if context is not None:
        ev, dt = ev[:, -context:], dt[:, -context:]
    return torch.from_numpy(np.ascontiguousarray(ev)), torch.from_numpy(np.ascontiguousarray(dt))


def train_classifier(
    w: Windows,
    targets: np.ndarray,
    n_events: int,
    n_out: int,
    cfg: ClassifierConfig,
    seed: int = 0,
    progress: object | None = None,
) -> SeqClassifier:
    """Train on windows `w` with integer `targets` for exactly cfg.steps steps (batches drawn with replacement)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = SeqClassifier(n_events, n_out, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    ev, dt = _inputs(w, cfg.context)
    y = torch.from_numpy(np.asarray(targets, dtype=np.int64))
    model.train()
    for _ in range(cfg.steps):
        idx = torch.from_numpy(rng.integers(0, len(y), cfg.batch))
        loss = nn.functional.cross_entropy(model(ev[idx], dt[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress is not None:
            progress()  # type: ignore[operator]
    return model


@torch.no_grad()
def predict_proba(model: SeqClassifier, w: Windows, cfg: ClassifierConfig, batch: int = 1024) -> np.ndarray:
    """Class probabilities, (n, n_out)."""
    model.eval()
    ev, dt = _inputs(w, cfg.context)
    out = [torch.softmax(model(ev[i : i + batch], dt[i : i + batch]), dim=-1) for i in range(0, len(ev), batch)]
    return torch.cat(out).numpy() if out else np.zeros((0, model.head.out_features))
