"""The denoiser: channel embeddings -> latent events -> patched transformer encoder -> predicted noise.

Diffusion runs in a continuous latent space, one vector per event: the concatenation of each
channel's embedding (learned tables for discrete channels, an MLP for dt), every part scaled to a
fixed norm so the embeddings cannot shrink towards the noise. The transformer sees `patch` events
per token (L/patch tokens), which is what keeps L=4096 affordable on a CPU with fused attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tracesynth.generators.diffusion.config import GaussianDiffusionConfig


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, N, D))


class Block(nn.Module):
    """Pre-LN transformer block whose norms are shifted and scaled by the timestep (adaLN)."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, elementwise_affine=False)
        self.attn = SelfAttention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.ada = nn.Linear(d, 4 * d)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        s1, b1, s2, b2 = self.ada(temb).unsqueeze(1).chunk(4, dim=-1)
        x = x + self.attn(self.ln1(x) * (1 + s1) + b1)
        return x + self.mlp(self.ln2(x) * (1 + s2) + b2)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _to_norm(x: torch.Tensor) -> torch.Tensor:
    """Rescale the last dim to norm sqrt(k) (unit variance per coordinate, like the noise)."""
    return x * (math.sqrt(x.shape[-1]) / x.norm(dim=-1, keepdim=True).clamp_min(1e-6))


class TraceDenoiser(nn.Module):
    def __init__(self, cfg: GaussianDiffusionConfig, vocab_sizes: dict[str, int]):
        super().__init__()
        self.cfg = cfg
        self.channels = cfg.channel_names
        self.dims = {c: cfg.latent_dim(c) for c in self.channels}
        self.discrete = [c for c in self.channels if c != "dt"]
        offs, o = {}, 0
        for c in self.channels:
            offs[c] = (o, o + self.dims[c])
            o += self.dims[c]
        self.offsets = offs
        self.latent = o
        # keys are prefixed: "cpu" would shadow nn.Module.cpu()
        self.emb = nn.ModuleDict({f"ch_{c}": nn.Embedding(vocab_sizes[c], self.dims[c]) for c in self.discrete})
        for e in self.emb.values():
            nn.init.normal_(e.weight)
        k = self.dims["dt"]
        self.dt_in = nn.Sequential(nn.Linear(1, 64), nn.SiLU(), nn.Linear(64, k))
        self.dt_out = nn.Sequential(nn.Linear(k, 64), nn.SiLU(), nn.Linear(64, 1))
        # Tokens never seen in training (unknown, unused labels) can never be sampled.
        for c in self.discrete:
            self.register_buffer(f"allowed_{c}", torch.ones(vocab_sizes[c], dtype=torch.bool))
        P, d = cfg.patch_size, cfg.d_model
        self.patch = P
        self.inp = nn.Linear(P * self.latent, d)
        self.pos = nn.Parameter(torch.randn(1, cfg.context // P, d) * 0.02)
        self.time = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.blocks = nn.ModuleList(Block(d, cfg.n_heads, cfg.dropout) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.out = nn.Linear(d, P * self.latent)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    # -- channels <-> latent ------------------------------------------------------------------
    def table(self, c: str) -> torch.Tensor:
        return _to_norm(self.emb[f"ch_{c}"].weight)

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Clean latent x0 [B, L, D] of a batch of windows (tokens [B, L], dt [B, L])."""
        parts = []
        for c in self.channels:
            if c == "dt":
                parts.append(_to_norm(self.dt_in(batch["dt"].unsqueeze(-1))))
            else:
                parts.append(F.embedding(batch[c], self.table(c)))
        return torch.cat(parts, dim=-1)

    def part(self, x: torch.Tensor, c: str) -> torch.Tensor:
        a, b = self.offsets[c]
        return x[..., a:b]

    def logits(self, x0: torch.Tensor, c: str) -> torch.Tensor:
        """Token logits of a discrete channel: minus squared distance to each embedding."""
        e = self.table(c)
        z = self.part(x0, c)
        d2 = (z * z).sum(-1, keepdim=True) - 2 * z @ e.T + (e * e).sum(-1)
        allowed = getattr(self, f"allowed_{c}")
        return (-d2).masked_fill(~allowed, -1e4)

    def dt_pred(self, x0: torch.Tensor) -> torch.Tensor:
        return self.dt_out(self.part(x0, "dt")).squeeze(-1)

    def round(self, x0: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each channel's nearest token (and decoded dt) for a latent [B, L, D]."""
        out = {c: self.logits(x0, c).argmax(-1) for c in self.discrete}
        out["dt"] = self.dt_pred(x0)
        return out

    def snap(self, x0: torch.Tensor) -> torch.Tensor:
        """Project a predicted latent onto the nearest token embeddings (hard clamping)."""
        return self.embed(self.round(x0))

    def soft_snap(self, x0: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Replace each discrete part by its expected embedding under softmax(-distance^2) (soft clamping).

        Unlike the hard snap this keeps the uncertainty of high-noise steps, where the nearest token
        to a blurred prediction is just the most common one (and sampling collapses onto it).
        """
        parts = []
        for c in self.channels:
            z = self.part(x0, c)
            parts.append(z if c == "dt" else torch.softmax(self.logits(x0, c) / temperature, -1) @ self.table(c))
        return torch.cat(parts, dim=-1)

    # -- denoiser -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted noise [B, L, D] for noisy latents x [B, L, D] at integer steps t [B]."""
        B, L, D = x.shape
        h = self.inp(x.reshape(B, L // self.patch, self.patch * D)) + self.pos[:, : L // self.patch]
        temb = self.time(timestep_embedding(t, self.cfg.d_model))
        h = h + temb.unsqueeze(1)
        for blk in self.blocks:
            h = blk(h, temb)
        return self.out(self.ln_f(h)).reshape(B, L, D)
