"""The KV-cache ``cat`` of an HF eager decode pass on a CPU, around glibc's 32 MiB mmap ceiling, three ways.

A decode step extends each layer's K and V cache with ``torch.cat``: a new block the size of the whole cache.
Up to 32 MiB a running engine reuses heap memory for it; above, glibc maps fresh pages (unless the heap holds a
free block that large: that depends on its history, see the README) and the kernel faults
in every 4 KiB of them on first touch, which costs several times the copy. For opt-125m (12 heads x 64, no
grouped KV) at KV 1024 the ceiling falls between 20 and 28 requests. Per shape it prints, in ms per pass
(24 cats):

* ``in model``: the cats' own time inside a real forward (thread clock around each op, median of the runs);
* ``plain``: the op timed in a loop as the profiler did before (faults or not as the allocator's history has
  it: a block freed in the loop may be reused, or the heap may grow under the samples);
* ``dooly``: what the profile now holds, the op timed on reused pages (``timing.reused_pages``), plus the
  predictor's fault term for an output above the ceiling (``predictor.page_faults``: its bytes at the
  machine's measured cost per byte, ``timing.measure_page_cost``). That cost includes unmapping the block,
  which inside the model is paid outside the cat (when the step frees the old cache block), so above the
  ceiling ``dooly`` should exceed ``in model`` by that share while matching the whole pass.

    .venv/bin/python bench/bench_page_faults.py --runs 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dooly.core.zoo import resolve_model
from dooly.engines import get_engine
from dooly.engines.base import RequestShape
from dooly.profile import TimerConfig, evict_caches, time_calls
from dooly.profile.timing import MMAP_MAX_BYTES, PAGE_COST_KEY, measure_page_cost, reused_pages

SHAPES = [(8, 1024), (16, 1024), (20, 1024), (28, 1024), (32, 1024), (48, 700)]


class CatTimer(TorchDispatchMode):
    """Thread-clock time of every ``aten.cat`` whose output is a KV cache (its third dim is the KV length)."""

    def __init__(self, kv_len: int) -> None:
        super().__init__()
        self.kv_len, self.total = kv_len, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and out.dim() == 4 and out.shape[2] == self.kv_len + 1:
            self.total += time.thread_time() - t0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="real forwards per shape (median)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = get_engine(dtype="bfloat16")
    _, cfg = resolve_model("opt-125m")
    torch.manual_seed(0)
    model = engine.build_model(cfg)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    hd = cfg["hidden_size"] // heads
    per_byte = measure_page_cost(clock="thread").median_s / PAGE_COST_KEY[2]["bytes"]
    print(f"opt-125m decode, KV-cache cats per pass ({2 * layers}), ms; fresh pages cost "
          f"{per_byte * 2**30:.3f} s per GiB here")  # fmt: skip
    print(f"{'requests':>8s} {'kv_len':>6s} {'out MiB':>7s} {'in model':>9s} {'plain':>8s} {'dooly':>8s}")
    timer = TimerConfig(warmup=2, repeats=9, budget_s=30.0)
    for req, kv in SHAPES:
        base = engine.prepare(model, RequestShape.decode(req, kv))
        samples = []
        for _ in range(args.runs + 1):  # the first run warms the heap up, as a running engine's is
            inputs = copy.deepcopy(base)
            evict_caches()
            with CatTimer(kv) as t:
                engine.forward(model, inputs)
            samples.append(t.total)
        in_model = statistics.median(samples[1:])
        out_bytes = req * heads * (kv + 1) * hd * 2
        copies = max(2, min(48, (96 * 2**20) // out_bytes))  # the cache passed in, rotated as the profiler does
        src = [torch.randn(req, heads, kv, hd).to(torch.bfloat16) for _ in range(copies)]
        new = torch.randn(req, heads, 1, hd).to(torch.bfloat16)

        def cat(i: int, src: list = src, new: torch.Tensor = new) -> torch.Tensor:
            return torch.cat([src[i % len(src)], new], dim=-2)

        plain = time_calls(cat, "cpu", timer, clock="thread").median_s
        with reused_pages():
            reused = time_calls(cat, "cpu", timer, clock="thread").median_s
        dooly = reused + (out_bytes * per_byte if out_bytes >= MMAP_MAX_BYTES else 0.0)
        n = 2 * layers
        print(f"{req:8d} {kv:6d} {out_bytes / 2**20:7.1f} {in_model * 1e3:9.1f} {n * plain * 1e3:8.1f} "
              f"{n * dooly * 1e3:8.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
