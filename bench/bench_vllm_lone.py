"""Lone requests on a real vLLM server: client TTFT against the predicted prefill forward, inter-token latency
against the predicted decode forward, and vLLM's own per-request timings (its /metrics).

Each request is served alone (nothing queued or batched with it), so the gap between measured and predicted is
what a served step costs beyond the model's forward. Figures only.

    .venv/bin/python bench/bench_vllm_lone.py --db out/bench-vllm/profiles.db smollm2-135m [more models]
"""

from __future__ import annotations

import argparse
import re
import urllib.request
from pathlib import Path

import numpy as np

PROMPTS = (16, 64, 128, 192, 256)
METRICS = ("time_to_first_token_seconds", "request_prefill_time_seconds", "request_queue_time_seconds",
           "inter_token_latency_seconds")  # fmt: skip


def engine_metrics(base_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of vLLM's per-request histograms."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    out = {}
    for name in METRICS:
        s = re.findall(rf"^vllm:{name}_sum\{{[^}}]*\}} ([0-9.e+-]+)", text, re.M)
        c = re.findall(rf"^vllm:{name}_count\{{[^}}]*\}} ([0-9.e+-]+)", text, re.M)
        if s and c:
            out[name] = (float(s[0]), float(c[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--db", type=Path, default=Path("out/bench-vllm/profiles.db"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=int, default=12, help="tokens each request generates")
    args = ap.parse_args()

    from dooly.api import serving_latency_model
    from dooly.serve.vllm_serving import ServeConfig, VLLMServer, cpu_serving_dtype, vllm_available
    from dooly.simulator import Workload

    why = vllm_available()
    if why:
        print(f"skipped: {why}")
        return
    dtype = cpu_serving_dtype()
    for model in args.models:
        pred, profiled_with = serving_latency_model(model, args.db, dtype, 1, "vllm")
        prompts = np.tile(PROMPTS, args.repeats)
        longest = pred.forward_latency("prefill", {"requests": 1, "tokens": max(PROMPTS)})
        longest += args.output * pred.forward_latency("decode", {"requests": 1, "kv_len": max(PROMPTS)})
        w = Workload(np.arange(len(prompts)) * (2 * longest + 0.2), prompts, np.full(len(prompts), args.output))
        with VLLMServer(model, ServeConfig(4, 256, dtype=dtype, max_model_len=512)) as srv:
            srv.bench(w)  # warm-up
            before = engine_metrics(srv.base_url)
            run = srv.bench(w)
            after = engine_metrics(srv.base_url)
        print(f"{Path(model).stem} (ops profiled with {profiled_with}, {dtype}, one engine thread):")
        for k, p in enumerate(PROMPTS):
            idx = range(k, len(prompts), len(PROMPTS))
            ttft = np.median(run.metrics.ttft[list(idx)])
            itl = np.median(np.concatenate([run.itl[i] for i in idx]))
            pf = pred.forward_latency("prefill", {"requests": 1, "tokens": p})
            dc = pred.forward_latency("decode", {"requests": 1, "kv_len": p + args.output // 2})
            print(f"  prompt {p:4d}: TTFT {ttft * 1e3:7.1f} ms, predicted prefill {pf * 1e3:7.1f} ms "
                  f"(+{(ttft - pf) * 1e3:5.1f}); ITL {itl * 1e3:6.1f} ms, predicted decode {dc * 1e3:6.1f} ms "
                  f"({(itl - dc) * 1e3:+5.1f})")  # fmt: skip
        for name in METRICS:
            if name in after and name in before:
                n = after[name][1] - before[name][1]
                mean = (after[name][0] - before[name][0]) / max(n, 1)
                print(f"  vLLM {name}: mean {mean * 1e3:.1f} ms over {n:.0f}")


if __name__ == "__main__":
    main()
