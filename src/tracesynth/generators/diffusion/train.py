"""The training loop: noise-prediction + reconstruction loss, AdamW, checkpoints, and DDP.

Run under `torchrun` and each process trains on its own random batches while
DistributedDataParallel averages the gradients (gloo on CPU, nccl on GPU); only rank 0 writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

from tracesynth.generators.diffusion.config import GaussianDiffusionConfig
from tracesynth.generators.diffusion.model import TraceDenoiser
from tracesynth.generators.diffusion.schedule import NoiseSchedule
from tracesynth.generators.distributed import agree_elapsed, init_distributed, wrap_ddp
from tracesynth.optim import warmup_cosine, world

Windows = dict[str, np.ndarray]
Checkpoint = Callable[[int, torch.optim.Optimizer, dict[str, Any]], None]


class DiffusionLoss(nn.Module):
    """One training step's loss, as a module so DDP sees every parameter used in forward()."""

    def __init__(self, model: TraceDenoiser, schedule: NoiseSchedule, aux_weight: float, prediction: str = "eps"):
        super().__init__()
        self.model = model
        self.schedule = schedule
        self.aux_weight = aux_weight
        self.prediction = prediction

    def forward(
        self, batch: dict[str, torch.Tensor], t: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        x0 = m.embed(batch)
        x_t = self.schedule.add_noise(x0, noise, t)
        out = m(x_t, t)
        if self.prediction == "eps":
            loss_main = F.mse_loss(out, noise)
            x0_hat = self.schedule.predict_x0(x_t, out, t)
            # Reconstruction from the predicted x0, weighted by alpha-bar: at high noise x0_hat is
            # necessarily poor and its gradient is amplified by 1/sqrt(abar), so it must not dominate.
            w = self.schedule.abar(t, x0).view(-1)
        else:
            # x0 parametrisation: the clean latent is regressed directly (well conditioned at every
            # t), and at high noise the cross-entropy teaches the token prior.
            x0_hat = out
            loss_main = F.mse_loss(out, x0)
            w = torch.ones_like(t, dtype=x0.dtype)
        aux = x0.new_zeros(())
        for z in (x0, x0_hat):  # the clean latent keeps the embeddings decodable and distinct
            for c in m.discrete:
                ce = F.cross_entropy(m.logits(z, c).transpose(1, 2), batch[c], reduction="none").mean(1)
                aux = aux + (ce if z is x0 else w * ce).mean()
            se = ((m.dt_pred(z) - batch["dt"]) ** 2).mean(1)
            aux = aux + (se if z is x0 else w * se).mean()
        return loss_main + self.aux_weight * aux, loss_main.detach()


def lr_at(step: int, cfg: GaussianDiffusionConfig, elapsed: float = 0.0) -> float:
    """The diffusion model's learning rate at `step` (`elapsed` seconds in): `warmup_cosine` over its config."""
    return warmup_cosine(cfg.lr, step, cfg.warmup, cfg.steps, cfg.time_limit or None, elapsed)


def to_device(w: Windows, device: torch.device) -> dict[str, torch.Tensor]:
    return {c: torch.as_tensor(v).to(device) for c, v in w.items()}


@torch.no_grad()
def evaluate(loss_mod: DiffusionLoss, val: dict[str, torch.Tensor], cfg: GaussianDiffusionConfig, device) -> float:
    """Mean loss on up to 64 validation windows with fixed noise (comparable across steps)."""
    n = min(64, len(val["event"]))
    if n == 0:
        return float("nan")
    g = torch.Generator(device="cpu").manual_seed(1234)
    loss_mod.eval()
    total = 0.0
    for a in range(0, n, cfg.batch_size):
        b = {c: v[a : min(n, a + cfg.batch_size)] for c, v in val.items()}
        k = len(b["event"])
        t = torch.randint(0, cfg.timesteps, (k,), generator=g).to(device)
        noise = torch.randn((k, cfg.context, loss_mod.model.latent), generator=g).to(device)
        total += float(loss_mod(b, t, noise)[0]) * k
    loss_mod.train()
    return total / n


def train(
    model: TraceDenoiser,
    cfg: GaussianDiffusionConfig,
    train_w: Windows,
    val_w: Windows,
    device: torch.device,
    start_step: int = 0,
    optimizer_state: dict[str, Any] | None = None,
    checkpoint: Checkpoint | None = None,
    progress: bool = True,
    start_seconds: float = 0.0,
) -> dict[str, Any]:
    """Train `model` in place up to cfg.steps; returns figures (losses, events/s, seconds trained).

    A resumed fit passes the seconds its checkpoint had trained (`start_seconds`): cfg.time_limit counts them."""
    distributed = init_distributed(device)
    rank, size, _ = world()
    schedule = NoiseSchedule(cfg.timesteps, cfg.schedule)
    model.to(device).train()
    loss_mod = DiffusionLoss(model, schedule, cfg.aux_weight, cfg.prediction)
    runner: nn.Module = loss_mod
    if distributed:
        runner = wrap_ddp(loss_mod, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state)
    data = to_device(train_w, device)
    val = to_device(val_w, device)
    # Each rank draws its own batches and noise; the step number keeps resumed runs on a fresh stream.
    g = torch.Generator(device="cpu").manual_seed(cfg.seed * 1000003 + rank * 7919 + start_step)
    hist: dict[str, Any] = {"loss": float("nan"), "loss_eps": float("nan"), "val_loss": float("nan")}
    bar = _fit_bar(enabled=progress and rank == 0)
    ema, events = None, 0
    t_run = time.perf_counter()
    t_start = t_run - start_seconds  # the time limit and the schedule count the seconds of earlier runs too

    def _checkpoint(done: int) -> None:
        hist["val_loss"] = evaluate(loss_mod, val, cfg, device)
        hist["steps"] = done
        hist["train_seconds"] = time.perf_counter() - t_start
        if rank == 0 and checkpoint is not None:
            checkpoint(done, opt, dict(hist))
        if distributed:
            dist.barrier()

    with bar:
        task = bar.add_task("fit", total=cfg.steps, completed=start_step, loss=float("nan"), val=float("nan"), eps=0.0)
        done = start_step
        for step in range(start_step, cfg.steps):
            elapsed = time.perf_counter() - t_start
            if cfg.time_limit > 0:
                elapsed = agree_elapsed(elapsed, distributed, device)
                if elapsed >= cfg.time_limit:
                    break
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step, cfg, elapsed)
            loss, loss_eps = _train_step(runner, model, opt, cfg, data, g, device)
            lv = loss.item()
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            hist["loss"], hist["loss_eps"] = ema, float(loss_eps)
            events += cfg.batch_size * cfg.context * size
            done = step + 1
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                _checkpoint(done)
            rate = events / max(1e-9, time.perf_counter() - t_run)
            bar.update(task, completed=done, loss=ema, val=hist["val_loss"], eps=rate)
        if done % cfg.checkpoint_every and done != cfg.steps:  # stopped by the time limit
            _checkpoint(done)
    hist["train_events_per_s"] = events / max(1e-9, time.perf_counter() - t_run)
    hist["train_seconds"] = time.perf_counter() - t_start
    hist["steps"] = done
    model.eval()
    return hist


def _fit_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]fit[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  val {task.fields[val]:.4f}  {task.fields[eps]:,.0f} events/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def _train_step(
    runner: nn.Module,
    model: TraceDenoiser,
    opt: torch.optim.Optimizer,
    cfg: GaussianDiffusionConfig,
    data: dict[str, torch.Tensor],
    g: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step on a batch of windows, timesteps and noise drawn from g (in that order)."""
    idx = torch.randint(0, len(data["event"]), (cfg.batch_size,), generator=g)
    batch = {c: v[idx.to(device)] for c, v in data.items()}
    t = torch.randint(0, cfg.timesteps, (cfg.batch_size,), generator=g).to(device)
    noise = torch.randn((cfg.batch_size, cfg.context, model.latent), generator=g).to(device)
    loss, loss_eps = runner(batch, t, noise)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss, loss_eps


# -- optimizer state without pickle -----------------------------------------------------------
def optimizer_to_tensors(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict (a live optimizer's or a loaded one) into named tensors
    (safetensors) and JSON-able groups."""
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = v
    return {"state": state, "param_groups": meta["param_groups"]}
