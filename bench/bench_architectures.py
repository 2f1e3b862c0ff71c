"""Sweep: trace a tiny config of every causal-LM architecture the installed transformers registers, in each phase.

Each architecture's config class is built with its defaults, then shrunk (hidden size 64, 2 layers, 4 heads,
vocab 128, ... wherever the config has such a field, sub-configs too) so the model builds in a second; where the
shrunk config does not build, the default config with 2 layers is used (tracing costs no weight memory).
Every phase ends as ``traced``, ``refused`` (a :class:`DoolyError`: the one-line reason is printed), ``engine
fails`` (also one line: the trace raised and so does a real run of the engine at small sizes, so the engine's own
code cannot run it; :func:`dooly.trace.tracer.real_run_failure`) or ``crashed`` (any other exception: a tracer bug).
A trace slower than ``--timeout`` seconds is ``crashed``.

    .venv/bin/python bench/bench_architectures.py                     # every architecture, every phase
    .venv/bin/python bench/bench_architectures.py mamba jamba --phases chunk
    .venv/bin/python bench/bench_architectures.py --shard 0/3 --json /tmp/a0.json   # a third; rerun resumes
    .venv/bin/python bench/bench_architectures.py --merge /tmp/a0.json /tmp/a1.json /tmp/a2.json
    .venv/bin/python bench/bench_architectures.py --engine vllm   # the ones vLLM's registry builds, on vLLM's classes

With ``--engine vllm`` the sweep takes the architectures whose causal-LM class vLLM registers (vLLM builds from the
config's ``architectures``) and traces them through vLLM's own model classes.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dooly.core.errors import DoolyError, one_line
from dooly.trace.tracer import DEFAULT_HINTS, real_run_failure, trace_model

PHASES = ("prefill", "decode", "chunk")

# A tiny value for each size field a config may have (set only where the config class has the attribute).
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # = heads: some architectures (latent attention) need it
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def tiny_configs(model_type: str) -> list[dict[str, Any]]:
    """Config dicts for ``model_type``, its defaults shrunk: plainly, then with the derived sizes made consistent
    (layer patterns cut to the new depth, token ids inside the vocabulary, SSM heads x head size = expand x
    hidden). The sweep takes the first that builds."""
    from transformers import AutoConfig, PretrainedConfig

    def shrink(cfg: PretrainedConfig, derived: bool) -> None:
        depth = getattr(cfg, "num_hidden_layers", None)
        top_k = getattr(cfg, "num_experts_per_tok", None)
        for key, value in TINY.items():
            if hasattr(cfg, key) and isinstance(getattr(cfg, key), int) and not isinstance(getattr(cfg, key), bool):
                setattr(cfg, key, value)
        for value in vars(cfg).values():
            if isinstance(value, PretrainedConfig):
                shrink(value, derived)
        n = getattr(cfg, "num_hidden_layers", None)
        if not derived:
            for key, value in list(vars(cfg).items()):
                if isinstance(n, int) and isinstance(value, list) and key.endswith("layer_types") and len(value) > n:
                    setattr(cfg, key, value[:n])
            return
        for key, value in list(vars(cfg).items()):
            if not (isinstance(n, int) and isinstance(value, list) and value):
                continue
            if len(value) == depth or key.endswith("layer_types"):  # a per-layer pattern: its first layers
                setattr(cfg, key, value[:n])
            elif key.endswith(("_indices", "_ids")) and all(isinstance(i, int) for i in value):  # layer numbers
                setattr(cfg, key, [i for i in value if i < n] or [n - 1])
        # token ids inside the vocabulary; an SSM mixer's heads x head size = expand x hidden
        vocab = getattr(cfg, "vocab_size", None)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(vocab, int) and isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= vocab:
                setattr(cfg, key, vocab - 1)
        # routing and SSM groups that divide the tiny expert and head counts; a query head the sum of its parts
        for key in ("n_group", "topk_group", "n_groups", "mamba_n_groups"):
            if hasattr(cfg, key) and (getattr(cfg, key) is None or isinstance(getattr(cfg, key), int)):
                setattr(cfg, key, 1)
        if hasattr(cfg, "num_experts_per_tok") and cfg.num_experts_per_tok is None:
            cfg.num_experts_per_tok = TINY["num_experts_per_tok"]
        elif isinstance(top_k, int) and top_k < TINY["num_experts_per_tok"]:
            cfg.num_experts_per_tok = top_k  # the model's own top-1 routing (an engine may implement only that)
        parts = [getattr(cfg, k, None) for k in ("qk_nope_head_dim", "qk_rope_head_dim")]
        if isinstance(getattr(cfg, "qk_head_dim", None), int) and all(isinstance(p, int) for p in parts):
            cfg.qk_head_dim = sum(parts)
        hidden = getattr(cfg, "hidden_size", None)
        ssm = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"))
        for heads, size, expand in ssm:
            if all(isinstance(getattr(cfg, k, None), int) for k in (heads, size, expand)) and isinstance(hidden, int):
                setattr(cfg, heads, 4)
                setattr(cfg, size, getattr(cfg, expand) * hidden // 4)

    out = []
    for derived in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.for_model(model_type)
            shrink(cfg, derived)
            out.append(cfg.to_dict())
    return out


def pick_tiny(engine: Any, model_type: str) -> dict[str, Any] | None:
    """The first tiny config whose real prefill runs; else the first that builds (its phases then report the
    engine's failure); None where none builds."""
    built = None
    try:
        for cand in tiny_configs(model_type):
            try:
                engine.build_model(cand)
            except Exception:  # noqa: BLE001,S112 - the next candidate, then the defaults
                continue
            built = built or cand
            if real_run_failure(engine, cand, "prefill", DEFAULT_HINTS["prefill"]) is None:
                return cand
    except Exception:  # noqa: BLE001,S110 - the defaults
        pass
    return built


def default_config(model_type: str) -> dict[str, Any]:
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type)
    doc = cfg.to_dict()
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(doc.get(key), int):
            doc[key] = min(doc[key], 2)
    for key, value in list(doc.items()):  # a per-layer pattern follows the depth, as a user's config would
        if key.endswith("layer_types") and isinstance(value, list) and len(value) > 2:
            doc[key] = value[:2]
    return doc


def vllm_model_types(model_types: list[str]) -> list[str]:
    """The model types whose causal-LM class (the ``architectures`` a config gets) vLLM's registry builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    return [mt for mt in model_types if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt) in supported]


def sweep(
    model_types: list[str],
    phases: list[str],
    timeout: int,
    console: Console,
    save: Path | None = None,
    engine_name: str = "hf-eager",
    tp: int = 1,
) -> list[dict[str, Any]]:
    """Trace each architecture in each phase; with ``save``, rows are written there after each architecture and
    the architectures already in it are skipped (a sweep cut short by a time limit resumes)."""
    from dooly.engines import get_engine

    engine = get_engine(engine_name, tp=tp)
    rows = json.loads(save.read_text()) if save is not None and save.exists() else []
    done = {r["arch"] for r in rows}
    signal.signal(signal.SIGALRM, _alarm)
    for mt in model_types:
        if mt in done:
            continue
        if save is not None:
            # the engine's C++ may kill the process on real tensors (a signal, no exception): a resumed sweep
            # finds this row and goes on with the next architecture
            died = {
                "arch": mt,
                "phase": "-",
                "result": "engine fails",
                "config": "tiny",
                "reason": "the engine's own kernels killed the process in a real step of the tiny config",
            }
            save.write_text(json.dumps([*rows, died], indent=1))
        cfg, made = pick_tiny(engine, mt), "tiny"
        if cfg is None:
            try:
                cfg, made = default_config(mt), "default"
            except Exception as exc:  # noqa: BLE001
                rows.append({"arch": mt, "phase": "-", "result": "no config", "reason": one_line(exc), "config": "-"})
                continue
        for ph in phases:
            t0 = time.perf_counter()
            result, reason = trace_phase(engine, cfg, mt, ph, real=made == "tiny", timeout=timeout)
            row = {
                "arch": mt,
                "phase": ph,
                "result": result,
                "reason": reason,
                "config": made,
                "seconds": round(time.perf_counter() - t0, 2),
            }
            rows.append(row)
            console.print(f"{mt} {ph} {made}: {result} ({row['seconds']} s) {reason}", highlight=False, markup=False)
    if save is not None:
        save.write_text(json.dumps(rows, indent=1))
    return rows


def trace_phase(engine: Any, cfg: dict[str, Any], mt: str, ph: str, *, real: bool, timeout: int) -> tuple[str, str]:
    """One phase's result and reason; with ``real``, a traced phase is also run on real tensors, since the trace's
    fake kernels compute nothing and so cannot fail where the engine's own code does."""
    signal.alarm(timeout)
    try:
        tr = trace_model(cfg, ph, name=mt, engine=engine)
        failure = real_run_failure(engine, cfg, ph, DEFAULT_HINTS[ph]) if real else None
        if failure is not None:
            return "engine fails", f"the engine cannot run this model's {ph} even on real tensors ({failure})"
        return "traced", f"{len(tr.records)} ops"
    except DoolyError as exc:  # one line; the tracer says when the engine fails on real tensors too
        return "engine fails" if "even on real tensors" in str(exc) else "refused", str(exc)
    except _Timeout:
        return "crashed", f"timeout after {timeout} s"
    except Exception as exc:  # noqa: BLE001
        return "crashed", one_line(exc)
    finally:
        signal.alarm(0)


def report(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="dooly trace over every causal-LM architecture of the installed transformers")
    for col in ("architecture", "config", *PHASES, "reason (first refusal / crash)"):
        table.add_column(col)
    by_arch: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_arch.setdefault(r["arch"], {})[r["phase"]] = r
    for arch, phs in sorted(by_arch.items()):
        bad = [r for r in phs.values() if r["result"] != "traced"]
        cfg = next(iter(phs.values()))["config"]
        cells = [phs[p]["result"] if p in phs else ("-" if "-" not in phs else phs["-"]["result"]) for p in PHASES]
        table.add_row(arch, cfg, *cells, bad[0]["reason"] if bad else "", style=None)
    console.print(table)
    per_phase = Counter((r["phase"], r["result"]) for r in rows)
    for ph in PHASES:
        counts = {res: per_phase[(ph, res)] for res in ("traced", "refused", "engine fails", "crashed")}
        console.print(f"{ph}: " + ", ".join(f"{n} {res}" for res, n in counts.items()), highlight=False)
    archs = Counter()
    for _arch, phs in by_arch.items():
        results = {r["result"] for r in phs.values()}
        archs["crashed" if "crashed" in results else "traced" if results == {"traced"} else
              "no config" if "no config" in results else "refused or failing in some phase"] += 1  # fmt: skip
    console.print(f"architectures: {len(by_arch)}; " + ", ".join(f"{n} {k}" for k, n in sorted(archs.items())))
    reasons = Counter(r["reason"] for r in rows if r["result"] in ("refused", "crashed"))
    console.print("most common reasons:")
    for reason, n in reasons.most_common(12):
        console.print(f"  {n:4d}  {reason[:200]}", highlight=False, markup=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archs", nargs="*", help="model_type names (default: every causal-LM architecture)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--timeout", type=int, default=150, help="seconds per trace before it counts as crashed")
    ap.add_argument("--shard", default="0/1", help="I/N: run the I-th of N equal slices of the architectures")
    ap.add_argument("--json", type=Path, help="write the rows here (and resume from it: its architectures are skipped)")
    ap.add_argument("--merge", type=Path, nargs="+", help="skip tracing: print the table of these --json files")
    ap.add_argument("--engine", default="hf-eager", help="hf-eager (default) or vllm")
    ap.add_argument("--tp", type=int, default=1, help="trace rank 0 of a tensor-parallel replica (vllm)")
    a = ap.parse_args()
    console = Console(width=220)
    if a.merge:
        rows = [r for f in a.merge for r in json.loads(f.read_text())]
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        archs = a.archs or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        if a.engine == "vllm":  # vLLM's CPU attention has no kernel for 16-wide heads ("Unsupported CPU attention")
            # and its CPU latent attention decodes a 512 + 64 latent only
            TINY.update(hidden_size=128, head_dim=32, kv_lora_rank=512, qk_rope_head_dim=64)
        if a.engine == "vllm" and not a.archs:
            every = archs
            archs = vllm_model_types(every)
            console.print(f"{len(archs)} of {len(every)} causal-LM architectures have a class vLLM registers")
        i, n = (int(x) for x in a.shard.split("/"))
        archs = archs[i::n]
        rows = sweep(archs, a.phases.split(","), a.timeout, console, a.json, engine_name=a.engine, tp=a.tp)
    report(rows, console)


if __name__ == "__main__":
    main()
