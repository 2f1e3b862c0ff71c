"""Reverse-process samplers, swappable like diffusers' schedulers: `set_timesteps`, then `step`.

AncestralSampler is the DDPM sampler over every training step (T=1000); DDIMSampler strides over
a few of them (deterministic, eta=0 by default). Both accept `x0_fn`, a hook that may replace the
predicted clean latent (e.g. snap it to the nearest token embeddings) before the update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tracesynth.generators.diffusion.schedule import NoiseSchedule

X0Fn = Callable[[torch.Tensor], torch.Tensor] | None


class AncestralSampler:
    """DDPM ancestral sampling (Ho et al. 2020, Algorithm 2)."""

    name = "ancestral"

    def __init__(self, schedule: NoiseSchedule):
        self.schedule = schedule
        self.timesteps = list(range(schedule.timesteps - 1, -1, -1))

    def set_timesteps(self, n: int | None = None) -> None:
        """Ancestral sampling visits every training step; `n` must be None or T."""
        if n not in (None, self.schedule.timesteps):
            raise ValueError(f"the ancestral sampler runs all {self.schedule.timesteps} steps; use ddim for fewer")
        self.timesteps = list(range(self.schedule.timesteps - 1, -1, -1))

    def step(self, eps: torch.Tensor, t: int, x: torch.Tensor, generator: torch.Generator, x0_fn: X0Fn = None):
        s = self.schedule
        abar_t = float(s.alphas_cumprod[t])
        abar_prev = float(s.alphas_cumprod[t - 1]) if t > 0 else 1.0
        beta_t = float(s.betas[t])
        x0 = (x - (1 - abar_t) ** 0.5 * eps) / abar_t**0.5
        if x0_fn is not None:
            x0 = x0_fn(x0)
        # Posterior mean of q(x_{t-1} | x_t, x0) written with x0 (equivalent to the eps form).
        c0 = abar_prev**0.5 * beta_t / (1 - abar_t)
        ct = (1 - beta_t) ** 0.5 * (1 - abar_prev) / (1 - abar_t)
        mean = c0 * x0 + ct * x
        if t == 0:
            return mean
        var = beta_t * (1 - abar_prev) / (1 - abar_t)
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        return mean + var**0.5 * noise


class DDIMSampler:
    """DDIM (Song et al. 2021) over an evenly strided subset of the training steps."""

    name = "ddim"

    def __init__(self, schedule: NoiseSchedule, steps: int = 50, eta: float = 0.0):
        self.schedule = schedule
        self.eta = eta
        self.set_timesteps(steps)

    def set_timesteps(self, n: int | None = None) -> None:
        T = self.schedule.timesteps
        n = max(1, min(int(n or 50), T))
        ts = torch.linspace(T - 1, 0, n).round().long().unique_consecutive()
        self.timesteps = [int(t) for t in ts]
        self._prev = {
            t: (self.timesteps[i + 1] if i + 1 < len(self.timesteps) else -1) for i, t in enumerate(ts.tolist())
        }

    def step(self, eps: torch.Tensor, t: int, x: torch.Tensor, generator: torch.Generator, x0_fn: X0Fn = None):
        s = self.schedule
        prev = self._prev[t]
        abar_t = float(s.alphas_cumprod[t])
        abar_prev = float(s.alphas_cumprod[prev]) if prev >= 0 else 1.0
        x0 = (x - (1 - abar_t) ** 0.5 * eps) / abar_t**0.5
        if x0_fn is not None:
            x0 = x0_fn(x0)
            eps = (x - abar_t**0.5 * x0) / (1 - abar_t) ** 0.5  # keep eps consistent with the snapped x0
        sigma = self.eta * ((1 - abar_prev) / (1 - abar_t) * (1 - abar_t / abar_prev)) ** 0.5
        direction = max(1 - abar_prev - sigma**2, 0.0) ** 0.5 * eps
        out = abar_prev**0.5 * x0 + direction
        if sigma > 0 and prev >= 0:
            out = out + sigma * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        return out


def make_sampler(name: str, schedule: NoiseSchedule, steps: int | None = None):
    """'ancestral' (all T steps) or 'ddim' (`steps` strided steps)."""
    if name == "ancestral":
        return AncestralSampler(schedule)
    if name == "ddim":
        return DDIMSampler(schedule, steps or 50)
    raise ValueError(f"unknown sampler {name!r} (ancestral or ddim)")
