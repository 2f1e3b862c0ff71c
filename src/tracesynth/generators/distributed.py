"""What a network needs to train under `torchrun` (DDP): the process group, the wrapper and the agreements.

Every trained generator (the Gaussian diffusion model and the token models: ar, masked, block) uses these:
gloo on the CPU, nccl on a GPU; each rank draws its own batches, DDP averages the gradients, only rank 0 writes.
Outside torchrun (WORLD_SIZE 1) every helper is a no-op, so a single process trains exactly as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tracesynth.optim import world


def init_distributed(device: torch.device) -> bool:
    """Join the process group when launched by torchrun with more than one process."""
    _, size, _ = world()
    if size <= 1:
        return False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def is_main_process() -> bool:
    """Rank 0: the one process that writes checkpoints and models and prints."""
    return world()[0] == 0


def processes() -> int:
    """Processes training together (1 outside a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def wrap_ddp(module: nn.Module, device: torch.device, find_unused: bool = False) -> nn.Module:
    """`module` in DistributedDataParallel (its forward must compute the loss, so that DDP sees every
    parameter used); `find_unused` for a loss that may skip a parameter on some steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(module, device_ids=ids, find_unused_parameters=find_unused)


def agree_elapsed(elapsed: float, distributed: bool, device: torch.device) -> float:
    """The longest rank's seconds: the time limit stops every rank at the same step (once any rank is past it)
    and the time-based learning rate is the same on all (DDP assumes every rank takes the same optimiser step)."""
    if not distributed:
        return elapsed
    t = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather_ints(value: int, device: torch.device) -> list[int]:
    """Each rank's `value`, by rank (every rank must call it)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(size, dtype=torch.int64, device=device)
    t[rank] = value
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]
