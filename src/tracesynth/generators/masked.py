"""Masked (absorbing-state) discrete diffusion over the trace channels (MDLM, Sahoo et al. 2024).

The tokens, chained sampling, decoding and storage are those of every token generator
(`tracesynth.generators.tokens`). Training masks each token independently with a rate t ~ U(0, 1) per
window and a bidirectional transformer predicts the clean tokens (cross-entropy on the masked ones).
Sampling starts from an all-masked window and unmasks the predictions in a random order (the
reverse of the masking process; or the most confident first, `unmask="confidence"`; or the earliest
events first, `unmask="left"`), over a configurable number of steps; a chained window is
conditioned on the overlap with the one before (inpainting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from tracesynth.generators.guide import KernelGuide
from tracesynth.generators.tokens import CHANNELS, ChannelTransformer, TokenConfig, TokenModel

FORMAT = "tracesynth-masked-1"
UNMASK = ("random", "confidence", "left")


@dataclass
class MaskedConfig(TokenConfig):
    # the diffusion model's size and optimiser (GaussianDiffusionConfig), what `tracesynth fit --kind masked` trains
    context: int = 1024
    d_model: int = 64
    n_layers: int = 2
    batch_size: int = 8
    lr: float = 3e-3
    steps: int = 1000
    sample_steps: int = 64
    # which masked tokens a step reveals: "random" (MDLM's reverse process), "confidence" (the most confident
    # first) or "left" (the earliest events first, event type before the other channels: semi-autoregressive)
    unmask: str = "random"

    kind: ClassVar[str] = "masked"
    what: ClassVar[str] = "masked diffusion"

    def _checks(self) -> dict[str, bool]:
        return {
            **super()._checks(),
            "sample_steps > 0": self.sample_steps > 0,
            "unmask in (random, confidence, left)": self.unmask in UNMASK,
        }


class Denoiser(ChannelTransformer):
    """Bidirectional transformer: summed channel embeddings (+ [MASK] per channel) -> logits per channel."""

    def forward(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = self.encode(self.condition(self.embed_tokens(tokens), tokens))
        return {c: self.heads[f"c_{c}"](x) for c in self.vocab}


class MaskedDiffusion(TokenModel):
    """Generator (fit / sample / save / load) of masked discrete diffusion over trace windows."""

    name = "masked"
    format = FORMAT
    config_cls = MaskedConfig
    skips_parameters = True  # a channel none of whose tokens a step masks leaves its head out of the loss

    def _network(self) -> Denoiser:
        return Denoiser(self.config, self.vocab, len(self.workloads))

    def loss(self, clean: dict[str, torch.Tensor]) -> torch.Tensor:
        """Masked cross-entropy: mask each token with rate t ~ U(0,1) per window, predict the clean ones."""
        b, L = clean["event"].shape
        dev = clean["event"].device
        t = torch.rand(b, 1, device=dev).clamp_min(1e-3)
        masks = {c: torch.rand(b, L, device=dev) < t for c in CHANNELS}
        noisy = {**clean, **{c: torch.where(masks[c], self.vocab[c], clean[c]) for c in CHANNELS}}
        logits = self.model(noisy)
        total, count = 0.0, 0
        for c in CHANNELS:
            m = masks[c]
            if m.any():
                total = total + F.cross_entropy(logits[c][m], clean[c][m], reduction="sum")
                count += int(m.sum())
        return total / max(count, 1)

    @torch.no_grad()
    def _fill(
        self,
        tokens: dict[str, torch.Tensor],
        known: torch.Tensor,
        gen: torch.Generator,
        guide: KernelGuide | None = None,
    ) -> None:
        """Unmask every token not `known` ([b, L] event positions), a share per step, in place."""
        cfg = self.config
        masked = {c: ~known.clone() for c in CHANNELS}
        for c in CHANNELS:
            tokens[c][masked[c]] = self.vocab[c]
        total = int(sum(m.sum() for m in masked.values()))
        for s in range(cfg.sample_steps):
            left = int(sum(m.sum() for m in masked.values()))
            if left == 0:
                break
            # linear schedule: after step s, a fraction 1 - (s+1)/S of the tokens stays masked
            target = int(math.floor(total * (1 - (s + 1) / cfg.sample_steps)))
            n_open = left - target
            logits = self.model(tokens)
            cand, conf = {}, []
            for rank, c in enumerate(CHANNELS):
                draw, logp = self._draw(logits[c], c, gen)
                cand[c] = draw
                if cfg.unmask == "confidence":
                    score = logp.exp()
                elif cfg.unmask == "left":  # position j before j + 1; within an event, CHANNELS order
                    L = draw.shape[1]
                    score = ((L - torch.arange(L, dtype=torch.float32)) * len(CHANNELS) - rank).expand_as(draw)
                else:  # a uniformly random subset of the masked tokens
                    score = torch.rand(draw.shape, generator=gen)
                conf.append(torch.where(masked[c], score, torch.full_like(score, -1.0)))
            flat = torch.stack(conf).reshape(-1)  # [channels * b * L]
            if n_open >= left:
                chosen = flat >= 0
            else:
                chosen = torch.zeros_like(flat, dtype=torch.bool)
                chosen[torch.topk(flat, n_open).indices] = True
            chosen = chosen.reshape(len(CHANNELS), *known.shape)
            for i, c in enumerate(CHANNELS):
                tokens[c] = torch.where(chosen[i], cand[c], tokens[c])
                masked[c] &= ~chosen[i]
