"""Block diffusion over the trace channels (BD3-LM, Arriola et al. ICLR 2025): autoregressive over blocks of
`block` events, masked discrete diffusion over the events inside the current block.

The tokens, chained sampling, decoding, storage, workload conditioning and checkpoints are those of every token
generator (`tracesynth.generators.tokens`); the network is the autoregressive model's (`ar.CausalNet`, same
weights, same names), so `fit(init=)` starts from a fitted `ar` model such as the shipped models/all (as
DiffuGPT starts a diffusion model from GPT-2). As there, the input at position p is event p-1 (the AR shift): the
hidden state at p predicts event p, and each channel's head sees the channels of that event drawn before it
(`ar.ORDER`: cpu, tid, event, comm, ret, dt).

What is masked is a whole event: every channel token of an event is masked together, and a revealed event is
drawn channel after channel from its position's hidden state (its channels chosen jointly, as the AR heads do).
Training runs every block in one pass over the noised window and the clean one side by side (BD3-LM's x_t ⊕ x_0):
a noised block attends to itself and to the clean blocks before it, clean blocks attend block-causally among
themselves. Each window gets a mask rate t ~ U[mask_low, mask_high] (the clipped schedule: the bounds were
chosen by the variance of the loss, results/block-diffusion.log), each event of it is masked with probability
t, and the loss is the masked events' cross-entropy weighted 1/t (MDLM's weight for the linear schedule).

Sampling fills a window block by block, each in `block_steps` passes of the network that reveal its unknown
events left to right (the last event alone, the others in near-equal shares): the kernel guide
(`tracesynth.generators.guide`) can only judge an event once the events before it are fixed, so events are revealed in
order, each one's channels drawn one at a time within the guide's masks, and committed before the next. The keys
and values of finished blocks are kept (a KV cache): a pass computes only the block being denoised (the pass that
draws a block's last event leaves the finished block's keys and values, since that event is no input of its own
block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from tracesynth.errors import TraceSynthError
from tracesynth.generators.ar import ORDER, Autoregressive, CausalNet
from tracesynth.generators.guide import GUIDES, KernelGuide
from tracesynth.generators.tokens import CHANNELS, WARM_START_SAME, TokenConfig, TokenModel

FORMAT = "tracesynth-block-1"


@dataclass
class BlockConfig(TokenConfig):
    # the AR checkpoint's network size and optimiser (ARConfig), so that fit(init=models/all) needs no option
    context: int = 256
    d_model: int = 128
    n_layers: int = 2
    batch_size: int = 32
    lr: float = 1e-3
    steps: int = 1000
    block: int = 16  # events per block (B): autoregressive across blocks, diffusion within
    block_steps: int | None = None  # network passes per block while sampling (K <= B; None: B // 2): B / K events each
    # the clipped mask-rate schedule t ~ U[mask_low, mask_high]: of U[0, 1] and five clipped ones, the lowest
    # variance of the loss (results/block-diffusion.log: 0.0011 against 0.0049 for U[0, 1], B=16, scimark2)
    mask_low: float = 0.45
    mask_high: float = 0.95
    guide: str | None = None  # as ARConfig's: None is "kernel" with channels=6, else "none"

    kind: ClassVar[str] = "block"
    what: ClassVar[str] = "block diffusion"

    def __post_init__(self) -> None:
        if self.guide is None:
            self.guide = "kernel" if self.channels == 6 else "none"
        if self.block_steps is None:
            self.block_steps = max(1, self.block // 2) if isinstance(self.block, int) else 1
        super().__post_init__()

    def _checks(self) -> dict[str, bool]:
        return {
            **super()._checks(),
            "4 <= block <= 64": isinstance(self.block, int) and 4 <= self.block <= 64,
            "context divisible by block": isinstance(self.block, int)
            and self.block > 0
            and self.context % self.block == 0,
            "1 <= block_steps <= block": isinstance(self.block, int) and 1 <= self.block_steps <= self.block,
            "0 <= mask_low < mask_high <= 1": 0 <= self.mask_low < self.mask_high <= 1,
            "guide in (kernel, none)": self.guide in GUIDES,
            "the kernel guide only with channels=6": self.guide != "kernel" or self.channels == 6,
        }


def block_causal(q_pos: torch.Tensor, k_pos: torch.Tensor, block: int) -> torch.Tensor:
    """[n_q, n_k] bool: query position may attend key position (its own block and the ones before)."""
    return (k_pos[None, :] // block) <= (q_pos[:, None] // block)


class BlockNet(CausalNet):
    """The AR network (`CausalNet`, the same parameters), run with block attention masks and a KV cache."""

    def __init__(self, cfg: BlockConfig, vocab: dict[str, int], n_workloads: int = 0):
        super().__init__(cfg, vocab, n_workloads)
        self.block = cfg.block

    def shifted(self, tokens: dict[str, torch.Tensor], start: int, end: int) -> torch.Tensor:
        """Inputs [b, end - start, d] of positions start..end-1: events start-1..end-2 (the start vector at 0)."""
        x = self.embed_tokens({c: tokens[c][:, max(start - 1, 0) : end - 1] for c in self.vocab})
        if start == 0:
            x = torch.cat([self.bos.expand(x.shape[0], 1, -1), x], dim=1)
        return self.condition(x, tokens)

    def attend(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: list[list[torch.Tensor]] | None = None, start: int = 0
    ) -> torch.Tensor:
        """Hidden states of inputs x [b, n, d] (positions added); mask [n, keys] bool (None: all). With `cache`, x holds
        positions start..start+n-1, their keys and values are written there and the keys are cache[:start+n]."""
        b, n, d = x.shape
        H = self.n_heads
        for layer, kv in zip(self.body.layers, cache or [None] * len(self.body.layers), strict=True):
            attn = layer.self_attn
            q, k, v = (
                F.linear(layer.norm1(x), attn.in_proj_weight, attn.in_proj_bias)
                .view(b, n, 3, H, d // H)
                .permute(2, 0, 3, 1, 4)
            )
            if kv is not None:
                kv[0][:, :, start : start + n] = k
                kv[1][:, :, start : start + n] = v
                k, v = kv[0][:, :, : start + n], kv[1][:, :, : start + n]
            drop = attn.dropout if self.training else 0.0
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
            x = x + layer.dropout1(attn.out_proj(o.transpose(1, 2).reshape(b, n, d)))
            x = x + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(layer.norm2(x))))))
        return self.norm(x)

    def denoise(self, noisy: dict[str, torch.Tensor], clean: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states [b, L, d] of the noised window, every block in one pass beside the clean window: noised
        block i sees itself and clean blocks < i; the first input of a block is the clean event before it."""
        L = clean["event"].shape[1]
        pos = torch.arange(L, device=self.pos.device)
        first = (pos % self.block == 0)[None, :, None]  # the event before a block is known while it is denoised
        xc = self.shifted(clean, 0, L)
        xn = torch.where(first, xc, self.shifted(noisy, 0, L))
        x = torch.cat([xn, xc], dim=1) + self.pos[:L].repeat(2, 1)
        blk = pos // self.block
        same, before = blk[:, None] == blk[None, :], blk[:, None] > blk[None, :]
        mask = torch.cat([torch.cat([same, before], 1), torch.cat([torch.zeros_like(same), same | before], 1)], 0)
        return self.attend(x, mask)[:, :L]

    def run(
        self, tokens: dict[str, torch.Tensor], start: int, end: int, cache: list[list[torch.Tensor]]
    ) -> torch.Tensor:
        """Hidden states of positions start..end-1 (the blocks they cover) given the cache of the blocks before."""
        x = self.shifted(tokens, start, end) + self.pos[start:end]
        # one block attends to all the keys (None: SDPA's fast path); more blocks, block-causally
        mask = (
            block_causal(torch.arange(start, end), torch.arange(end), self.block) if end - start > self.block else None
        )
        return self.attend(x, mask, cache, start)


class BlockDiffusion(TokenModel):
    """Generator (fit / sample / save / load) of block diffusion over trace windows."""

    name = "block"
    format = FORMAT
    config_cls = BlockConfig
    guides = True

    def _network(self) -> BlockNet:
        return BlockNet(self.config, self.vocab, len(self.workloads))

    def _check_init(self, init: TokenModel) -> None:
        """A block model starts from a fitted ar model (the network is the same) or another block model."""
        if not isinstance(init, Autoregressive | BlockDiffusion) or init.model is None:
            raise TraceSynthError(
                f"{self.config.what}: can only start from a fitted ar or block model, "
                f"not a {getattr(init, 'name', type(init).__name__)} one"
            )
        differ = [
            f"{k} {getattr(self.config, k)} vs {getattr(init.config, k)}"
            for k in WARM_START_SAME
            if getattr(self.config, k) != getattr(init.config, k)
        ]
        if differ:
            raise TraceSynthError(
                f"{self.config.what}: the network must be the size of the one it starts from ({', '.join(differ)})"
            )

    def loss(self, clean: dict[str, torch.Tensor], t: torch.Tensor | None = None) -> torch.Tensor:
        """MDLM-weighted masked cross-entropy: per window t ~ U[mask_low, mask_high] (or `t`, [b]), each event
        masked with probability t (all its channels), the masked events' cross-entropy weighted 1/t, per token."""
        cfg, net = self.config, self.model
        b, L = clean["event"].shape
        dev = clean["event"].device
        if t is None:
            t = cfg.mask_low + (cfg.mask_high - cfg.mask_low) * torch.rand(b, device=dev)
        masked = torch.rand(b, L, device=dev) < t.clamp_min(1e-3)[:, None]
        noisy = {**clean, **{c: torch.where(masked, self.vocab[c], clean[c]) for c in CHANNELS}}
        h = net.denoise(noisy, clean)
        ce = sum(
            F.cross_entropy(net.head(h, i, clean).transpose(1, 2), clean[c], reduction="none")
            for i, c in enumerate(ORDER)
        )
        per_window = (ce * masked).sum(1) / (t.clamp_min(1e-3) * L * len(ORDER))
        return per_window.mean()

    @torch.no_grad()
    def _fill(
        self, tokens: dict[str, torch.Tensor], known: torch.Tensor, gen: torch.Generator, guide: KernelGuide | None
    ) -> None:
        """Fill the events after the known prefix block by block, `block_steps` passes per block, revealing
        each block's unknown events left to right (see the module's docstring)."""
        net: BlockNet = self.model
        B = self.config.block
        b, L = known.shape
        k = int(known[0].sum())
        for c in CHANNELS:
            tokens[c][:, k:] = self.vocab[c]
        cache = net.new_cache(b, L)
        clean_upto = 0  # positions whose cached keys and values are those of finished blocks
        for s in range(k // B * B, L, B):
            for i, chunk in enumerate(self._chunks(np.arange(max(k, s), s + B))):
                start = clean_upto if i == 0 else s
                h = net.run(tokens, start, s + B, cache)[:, s - start :]
                self._reveal(h, s, chunk, tokens, gen, guide)
            # the last pass saw every input of the block (events s-1..s+B-2) if it drew the last event alone: its
            # keys and values are the finished block's; else the next block's first pass computes them
            clean_upto = s + B if len(chunk) == 1 else s

    def _chunks(self, todo: np.ndarray) -> list[np.ndarray]:
        """The events each pass reveals, left to right: the last one alone (so that the last pass computes the
        finished block's cache), the others in block_steps - 1 near-equal shares."""
        K = min(self.config.block_steps, len(todo))
        if K == 1:
            return [todo]
        return [*np.array_split(todo[:-1], K - 1), todo[-1:]]

    def _reveal(
        self,
        h: torch.Tensor,
        s: int,
        chunk: np.ndarray,
        tokens: dict[str, torch.Tensor],
        gen: torch.Generator,
        guide: KernelGuide | None,
    ) -> None:
        """Draw the events `chunk` (window positions, in order) from the block's hidden states h [b, B, d]."""
        net: BlockNet = self.model
        if guide is None:  # every event of the chunk at once
            at = torch.as_tensor(chunk)
            z = h[:, at - s]
            for i, c in enumerate(ORDER):
                draw, _ = self._draw(net.head_of(z, i), c, gen)
                tokens[c][:, at] = draw
                if i + 1 < len(ORDER):
                    z = z + net.given[f"c_{c}"](draw)
            return
        for j in chunk:  # one event at a time: the guide judges it in the state the events before leave
            z, drawn = h[:, j - s], {}
            for i, c in enumerate(ORDER):
                allowed, instead = guide.allowed(c, drawn), guide.instead(c, drawn)
                drawn[c], _ = self._draw(net.head_of(z, i), c, gen, allowed, instead)
                tokens[c][:, j] = drawn[c]
                if i + 1 < len(ORDER):
                    z = z + net.given[f"c_{c}"](drawn[c])
            guide.commit(int(j), drawn)
