"""The DDPM noise schedule (forward process), kept apart from the network and the samplers."""

from __future__ import annotations

import math

import torch


class NoiseSchedule:
    """beta_1..beta_T and the cumulative products the forward process and the samplers need.

    `kind` is "linear" (Ho et al., 1e-4..0.02) or "cosine" (Nichol & Dhariwal).
    """

    def __init__(self, timesteps: int = 1000, kind: str = "linear"):
        if timesteps < 2:
            raise ValueError("timesteps must be at least 2")
        self.timesteps = timesteps
        self.kind = kind
        if kind == "linear":
            scale = 1000.0 / timesteps
            betas = torch.linspace(scale * 1e-4, scale * 0.02, timesteps, dtype=torch.float64)
        elif kind == "cosine":
            s = 0.008
            x = torch.linspace(0, timesteps, timesteps + 1, dtype=torch.float64)
            f = torch.cos(((x / timesteps) + s) / (1 + s) * math.pi / 2) ** 2
            abar = f / f[0]
            betas = (1 - abar[1:] / abar[:-1]).clamp(max=0.999)
        else:
            raise ValueError(f"unknown schedule {kind!r} (linear or cosine)")
        self.betas = betas
        self.alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)

    def abar(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """alpha-bar at integer steps t, shaped to broadcast over `like` ([B] -> [B, 1, 1])."""
        a = self.alphas_cumprod.to(like.device)[t.to(like.device)].to(like.dtype)
        return a.view(-1, *([1] * (like.dim() - 1)))

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """q(x_t | x_0): sqrt(abar) x0 + sqrt(1 - abar) noise."""
        a = self.abar(t, x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def predict_x0(self, x_t: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean latent implied by a noise prediction."""
        a = self.abar(t, x_t)
        return (x_t - (1 - a).sqrt() * eps) / a.sqrt()

    def predict_eps(self, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The noise implied by a clean-latent prediction (samplers consume noise)."""
        a = self.abar(t, x_t)
        return (x_t - a.sqrt() * x0) / (1 - a).sqrt()
