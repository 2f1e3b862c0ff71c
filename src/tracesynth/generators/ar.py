"""Autoregressive (causal) transformer over the trace channels: the plain peer of masked diffusion.

The tokens, chained sampling, decoding and storage are those of every token generator
(`tracesynth.generators.tokens`); so is the transformer body, run here with a causal mask. The input at
position p is event p-1 (a learned start vector at p = 0), and the hidden state there predicts
event p one channel at a time, in `ORDER`: each channel's head also sees the embeddings of the
channels of the same event already drawn, so an event's CPU, thread, type and return value are
drawn jointly rather than independently. The order is the kernel's (which CPU runs next, then
which thread is on it, then what that thread does), so that constraint-guided decoding
(`tracesynth.generators.guide`, the default `guide="kernel"`) can mask the thread with the CPU's current
one and the event type with that thread's open syscall. Sampling keeps each layer's keys and values (a
KV cache), so a new event costs one position through the network; a window of `context` events is
filled this way and the next window restarts from the last `overlap` events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tracesynth.generators.guide import GUIDES, KernelGuide
from tracesynth.generators.tokens import CHANNELS, ChannelTransformer, TokenConfig, TokenModel

FORMAT = "tracesynth-ar-2"  # -1 drew the event type first
ORDER = ("cpu", "tid", "event", "comm", "ret", "dt")  # the order an event's channels are drawn in
assert sorted(ORDER) == sorted(CHANNELS)


@dataclass
class ARConfig(TokenConfig):
    # the shipped checkpoint's recipe (scripts/train_models.py, models/all)
    context: int = 256
    d_model: int = 128
    n_layers: int = 2
    batch_size: int = 32
    lr: float = 1e-3
    steps: int = 1000
    # sampling: "kernel" masks draws with the kernel invariants, "none" does not; None: kernel where the model
    # has the cpu and thread channels the guide reads (channels=6), else none
    guide: str | None = None

    kind: ClassVar[str] = "ar"
    what: ClassVar[str] = "autoregressive model"

    def __post_init__(self) -> None:
        if self.guide is None:
            self.guide = "kernel" if self.channels == 6 else "none"
        super().__post_init__()

    def _checks(self) -> dict[str, bool]:
        return {
            **super()._checks(),
            "guide in (kernel, none)": self.guide in GUIDES,
            "the kernel guide only with channels=6": self.guide != "kernel" or self.channels == 6,
        }


class CausalNet(ChannelTransformer):
    """Causal transformer over events, with a per-channel head conditioned on the channels drawn before it."""

    def __init__(self, cfg: TokenConfig, vocab: dict[str, int], n_workloads: int = 0):
        super().__init__(cfg, vocab, n_workloads)
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.bos = nn.Parameter(torch.randn(d) * 0.02)
        # the next event's channels already drawn, as inputs of the later channels' heads
        self.given = nn.ModuleDict({f"c_{c}": nn.Embedding(vocab[c], d) for c in ORDER[:-1]})
        for e in self.given.values():
            nn.init.normal_(e.weight, std=0.02)
        self.query = nn.Parameter(torch.zeros(len(ORDER), d))  # which channel a head input is for
        self.head_norm = nn.LayerNorm(d)
        self.head_mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def hidden(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        """h[:, p] summarises events < p (teacher forcing over whole windows)."""
        x = self.embed_tokens(tokens)
        x = torch.cat([self.bos.expand(x.shape[0], 1, -1), x[:, :-1]], dim=1)
        return self.encode(self.condition(x, tokens), causal=True)

    def head(self, h: torch.Tensor, i: int, given: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of channel ORDER[i] from hidden h and the tokens `given` of channels ORDER[:i]."""
        return self.head_of(h + sum((self.given[f"c_{c}"](given[c]) for c in ORDER[:i]), torch.zeros(())), i)

    def head_of(self, z: torch.Tensor, i: int) -> torch.Tensor:
        """Logits of channel ORDER[i] from z = h + the given embeddings of the channels drawn before it."""
        z = z + self.query[i]
        z = z + self.head_mlp(self.head_norm(z))
        return self.heads[f"c_{ORDER[i]}"](z)

    def forward(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.hidden(tokens)
        return {c: self.head(h, i, tokens) for i, c in enumerate(ORDER)}

    # -- cached stepping (the same layers as `encode`, computed a few positions at a time) ------
    def step(self, x: torch.Tensor, start: int, cache: list[list[torch.Tensor]]) -> torch.Tensor:
        """Hidden states of inputs x [b, n, d] at positions start.. given cache (keys/values of earlier ones).

        A multi-position call is the prefill and must start at 0 (its causal mask is the plain one).
        """
        b, n, d = x.shape
        assert n == 1 or start == 0
        H = self.n_heads
        x = x + self.pos[start : start + n]
        for layer, kv in zip(self.body.layers, cache, strict=True):
            attn = layer.self_attn
            q, k, v = (
                F.linear(layer.norm1(x), attn.in_proj_weight, attn.in_proj_bias)
                .view(b, n, 3, H, d // H)
                .permute(2, 0, 3, 1, 4)
            )
            kv[0][:, :, start : start + n] = k
            kv[1][:, :, start : start + n] = v
            o = F.scaled_dot_product_attention(q, kv[0][:, :, : start + n], kv[1][:, :, : start + n], is_causal=n > 1)
            x = x + attn.out_proj(o.transpose(1, 2).reshape(b, n, d))
            x = x + layer.linear2(layer.activation(layer.linear1(layer.norm2(x))))
        return self.norm(x)

    def new_cache(self, batch: int, length: int) -> list[list[torch.Tensor]]:
        d = self.pos.shape[1]
        shape = (batch, self.n_heads, length, d // self.n_heads)
        return [[torch.zeros(shape), torch.zeros(shape)] for _ in self.body.layers]


class Autoregressive(TokenModel):
    """Generator (fit / sample / save / load) of a causal transformer over trace windows."""

    name = "ar"
    format = FORMAT
    config_cls = ARConfig
    guides = True

    def _network(self) -> CausalNet:
        return CausalNet(self.config, self.vocab, len(self.workloads))

    def loss(self, clean: dict[str, torch.Tensor]) -> torch.Tensor:
        """Next-event cross-entropy, averaged over every channel of every event of the windows."""
        logits = self.model(clean)
        return sum(F.cross_entropy(logits[c].flatten(0, 1), clean[c].reshape(-1)) for c in ORDER) / len(ORDER)

    @torch.no_grad()
    def _fill(
        self, tokens: dict[str, torch.Tensor], known: torch.Tensor, gen: torch.Generator, guide: KernelGuide | None
    ) -> None:
        """Draw the events after the known prefix one at a time, each channel given those drawn before
        it (and allowed by `guide`, if any)."""
        net: CausalNet = self.model
        b, L = known.shape
        k = int(known[0].sum())
        cache = net.new_cache(b, L)
        prefix = net.embed_tokens({c: tokens[c][:, :k] for c in CHANNELS})
        x = net.condition(torch.cat([net.bos.expand(b, 1, -1), prefix], dim=1), tokens)
        h = net.step(x, 0, cache)[:, -1]
        for j in range(k, L):
            drawn: dict[str, torch.Tensor] = {}
            z = h  # + the embeddings of this event's channels drawn so far (net.head, one channel at a time)
            for i, c in enumerate(ORDER):
                allowed = guide.allowed(c, drawn) if guide is not None else None
                instead = guide.instead(c, drawn) if guide is not None else None
                drawn[c], _ = self._draw(net.head_of(z, i), c, gen, allowed, instead)
                tokens[c][:, j] = drawn[c]
                if i + 1 < len(ORDER):
                    z = z + net.given[f"c_{c}"](drawn[c])
            if guide is not None:
                guide.commit(j, drawn)
            if j + 1 < L:
                x = net.condition(net.embed_tokens({c: v[:, None] for c, v in drawn.items()}), tokens)
                h = net.step(x, j + 1, cache)[:, 0]
