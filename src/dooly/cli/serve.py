"""`dooly simulate`, `validate-serving`, `export-vidur`, `report` and `demo`: serving questions from profiles."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dooly.api import load_latency_model, memory_model, sched_config, serving_latency_model, vllm_cpu_kv_blocks
from dooly.cli.app import app
from dooly.core.errors import DoolyError
from dooly.engines import DEFAULT_ENGINE

out = Console()


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:.1f}"


_ENGINE_HELP = (
    "Inference engine: hf-eager, or vllm (the simulator runs vLLM v1's scheduler; validate-serving serves with "
    "the real `vllm serve`; the ops' profiles are vLLM's when the DB has them, else hf-eager's)."
)


VLLM_BLOCK_SIZE = 128  # vLLM's CPU backend default (it prefers multiples of 32)
KVCACHE_HELP = "vLLM CPU backend: KV-cache GiB (VLLM_CPU_KVCACHE_SPACE); the KV blocks follow from it."


SIM_HELP = "Workload: a CSV/JSONL trace or a generator spec such as poisson:n=64,rate=2,prompt=32-256,output=16"


ROUTER_HELP = (
    "Global scheduler across replicas: round_robin, random (seeded by --router-seed) or least_outstanding "
    "(fewest requests queued or running at arrival)."
)


@app.command()
def simulate(
    model: str = typer.Argument(..., help="Model name (zoo) or config path, as profiled."),
    db: Path = typer.Option(..., "--db", help="Profile database (SQLite)."),
    workload: str = typer.Option("poisson:n=200,rate=2,prompt=32-512,output=8-128,seed=0", help=SIM_HELP),
    max_seqs: int = typer.Option(32, "--max-num-seqs", help="Most requests in one iteration."),
    max_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="Token budget of one iteration."),
    chunked: bool = typer.Option(False, "--chunked-prefill/--no-chunked-prefill", help="Split long prompts."),
    block_size: int = typer.Option(None, help="KV-cache block size in tokens (default 16; 128 for --engine vllm)."),
    cpu_kvcache_gb: int | None = typer.Option(None, "--cpu-kvcache-gb", help=KVCACHE_HELP),
    kv_blocks: int | None = typer.Option(
        None,
        "--num-kv-blocks",
        "--kv-blocks",
        help="KV-cache blocks per replica, explicit (overrides --memory-gb; 4096 when neither is given).",
    ),
    memory_gb: float | None = typer.Option(
        None, "--memory-gb", help="Device memory per replica in GiB: derive the KV blocks from it as vLLM does."
    ),
    gpu_util: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="Fraction of --memory-gb the engine may use (vLLM's default 0.9)."
    ),
    kv_cache_dtype: str = typer.Option("auto", help="KV-cache dtype: auto (= --dtype), a torch dtype, or fp8."),
    activation_gb: float | None = typer.Option(
        None, "--activation-gb", help="Activation reserve in GiB (default: estimated from the config and budget)."
    ),
    replicas: int = typer.Option(1, help="Replicas (requests spread by --router)."),
    router: str = typer.Option("round_robin", "--router", help=ROUTER_HELP),
    router_seed: int = typer.Option(0, "--router-seed", help="Seed of the random router."),
    sweep: bool = typer.Option(False, "--sweep", help="Sweep max tokens, max seqs and chunked prefill."),
    slo_ttft: float | None = typer.Option(None, "--slo-ttft", help="SLO on p90 TTFT, seconds."),
    slo_tpot: float | None = typer.Option(None, "--slo-tpot", help="SLO on p90 TPOT, seconds."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write per-request (or sweep) CSV here."),
    dtype: str = typer.Option("bfloat16", help="Engine dtype the model was profiled with."),
    engine: str = typer.Option(DEFAULT_ENGINE, "--engine", help=_ENGINE_HELP),
    shape: bool = typer.Option(
        False,
        "--shape/--no-shape",
        help="Predict signatures without a complete profile from their operator kind's shape model "
        "(after `dooly profile --budget`, or for a model never profiled).",
    ),
) -> None:
    """Simulate serving MODEL from its profiles; with --sweep, find the best config under an SLO."""
    from dooly.report import save_result
    from dooly.simulator import make_router, parse_workload
    from dooly.simulator.memory import DEFAULT_KV_BLOCKS
    from dooly.simulator.study import run_study

    make_router(router)  # an unknown name fails before any work
    w = parse_workload(workload)
    if engine == "vllm":  # vLLM v1's scheduler always chunks prefills
        chunked = True
    block_size = block_size or (VLLM_BLOCK_SIZE if engine == "vllm" else 16)
    if cpu_kvcache_gb is not None and kv_blocks is None:
        kv_blocks = vllm_cpu_kv_blocks(model, cpu_kvcache_gb, block_size, dtype)
        out.print(f"KV cache: {kv_blocks} blocks of {block_size} tokens in {cpu_kvcache_gb} GiB (vLLM CPU backend)")
    mem = None
    if memory_gb is not None:
        mem = memory_model(model, memory_gb, gpu_util, dtype, kv_cache_dtype, activation_gb, engine)
    kv = _size_kv_cache(sched_config(max_seqs, max_tokens, chunked, block_size, DEFAULT_KV_BLOCKS), mem, kv_blocks)
    latency, _ = serving_latency_model(model, db, dtype, None, engine, shape, log=out.print)
    study_args = dict(model=model, workload_spec=workload, workload=w, latency=latency, kv=kv, memory=mem)
    study_args.update(replicas=replicas, router=router, router_seed=router_seed)
    if sweep:
        study = _run_sweep(study_args, slo_ttft, slo_tpot)
        print_sweep(study)
    else:
        study = run_study(**study_args)
        _print_study(study, model, len(w))
    save_result(db, f"simulation-{Path(model).stem}", study.payload())
    if output:
        _save_csv(study, output, sweep)


def _size_kv_cache(cfg, mem, kv_blocks: int | None):  # type: ignore[no-untyped-def]
    """``cfg``'s KV cache per replica (see :func:`~dooly.simulator.memory.size_kv_cache`), printed when the
    memory model planned it."""
    from dooly.simulator.memory import size_kv_cache

    kv = size_kv_cache(cfg, mem, kv_blocks)
    if kv.plan is not None:
        out.print(f"KV cache: {kv.plan.describe()}")
        if kv.explicit:
            out.print(
                f"KV cache: {kv_blocks} blocks per replica from --num-kv-blocks "
                f"(memory would give {kv.plan.num_blocks})"
            )
        else:
            out.print(f"KV cache: {kv.plan.num_blocks} blocks per replica, derived from memory")
    return kv


def _run_sweep(study_args: dict, slo_ttft: float | None, slo_tpot: float | None):  # type: ignore[no-untyped-def]
    """`simulate --sweep`: the study over the config grid around the given config, with a progress bar."""
    from dooly.simulator.search import SLO, config_grid
    from dooly.simulator.study import run_study

    configs = config_grid(study_args["kv"].config)
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("simulating configs", total=len(configs))
        slo = SLO(slo_ttft, slo_tpot)
        return run_study(**study_args, slo=slo, configs=configs, progress=lambda: bar.advance(task))


def _print_study(study, model: str, n_requests: int) -> None:  # type: ignore[no-untyped-def]
    """The summary of one simulated configuration (and how the router spread the requests over replicas)."""
    cfg, res = study.kv.config, study.result
    title = f"{model}: {n_requests} requests, {cfg.label()} kv_blocks={cfg.num_kv_blocks}"
    if study.replicas > 1:
        title += f", {study.replicas} replicas ({study.router})"
    print_summary(res.summary, title)
    if study.replicas > 1:
        out.print(f"requests per replica: {', '.join(map(str, res.replica_counts()))}")


def _save_csv(study, output: Path, sweep: bool) -> None:  # type: ignore[no-untyped-def]
    """`--output`: the sweep table, or the per-request metrics of the one configuration."""
    if sweep:
        from dooly.report import write_sweep_csv

        write_sweep_csv(study.points, output)
        out.print(f"sweep table: {output}")
    else:
        study.result.metrics.save_csv(output)
        out.print(f"per-request metrics: {output}")


def print_sweep(study) -> None:  # type: ignore[no-untyped-def]
    top, per_config_kv = study.best, study.kv.per_config
    cols = ["seqs", "tokens", "chunked"] + (["KV blocks"] if per_config_kv else [])
    table = Table(*cols, "TTFT p90 s", "TPOT p90 s", "e2e p90 s", "tok/s", "SLO", box=None)
    for p in study.points:
        s = p.summary
        row = [
            str(p.config.max_num_seqs),
            str(p.config.max_num_batched_tokens),
            "yes" if p.config.chunked_prefill else "no",
        ]
        if per_config_kv:
            row.append(str(p.config.num_kv_blocks) if s is not None else "-")
        if s is None:
            table.add_row(*row, "-", "-", "-", "-", _infeasible(p.reason))
            continue
        verdict = ("best" if p is top else "meets") if p.meets_slo else "misses"
        table.add_row(
            *row,
            f"{s.ttft['p90']:.2f}",
            f"{s.tpot['p90']:.3f}",
            f"{s.e2e['p90']:.2f}",
            f"{s.throughput_tokens:.1f}",
            verdict,
        )
    out.print(table)
    if top is None:
        out.print(f"no configuration meets {study.slo.describe()}")
    else:
        out.print(
            f"best under {study.slo.describe()}: [bold]{top.config.label()}[/] "
            f"({top.summary.throughput_tokens:.1f} tok/s, TTFT p90 {_ms(top.summary.ttft['p90'])} ms)"
        )


def _infeasible(reason: str) -> str:
    """A short table cell for a configuration that cannot serve the workload."""
    if "max_num_batched_tokens=" in reason:
        return "n/a (request > budget)"
    if "KV blocks" in reason or "KV-cache" in reason:
        return "n/a (KV cache too small)"
    return "n/a"


def print_summary(s, title: str) -> None:
    table = Table("metric", "mean", "p50", "p90", "p99", title=title)
    for name in ("ttft", "tpot", "e2e"):
        d = getattr(s, name)
        table.add_row(f"{name.upper()} ms", _ms(d["mean"]), _ms(d["p50"]), _ms(d["p90"]), _ms(d["p99"]))
    out.print(table)
    out.print(
        f"throughput {s.throughput_tokens:.1f} output tok/s, {s.throughput_requests:.2f} req/s; "
        f"batch mean {s.mean_batch_size:.1f} (max {s.max_batch_size}); peak KV {s.peak_kv_usage:.0%}; "
        f"{s.preemptions} preemptions over {s.iterations} iterations"
    )


def run_validation(
    model: str,
    db: Path,
    workload: str,
    cfg,
    threads: int,
    dtype: str,
    clock: str,
    real_runs: int = 2,
    engine: str = DEFAULT_ENGINE,
    device: str = "cpu",
) -> dict:
    """Serve `workload` on the real engine `real_runs` times, simulate it from the profiles, return the payload.

    The simulator is scored against each request's median over the real runs; the runs' own spread is
    reported beside it (the noise floor: no prediction agrees with a run better than the runs agree).
    """
    import numpy as np

    from dooly.core.zoo import resolve_model
    from dooly.engines import get_engine
    from dooly.serve.serving import average_runs, compare, request_spread, serve
    from dooly.simulator import CachedLatency, parse_workload
    from dooly.simulator import simulate as run_sim

    w = parse_workload(workload)
    latency = CachedLatency(load_latency_model(model, db, dtype, threads, engine, device=device))
    eng = get_engine(engine, device=device, dtype=dtype)
    served = eng.build_model(resolve_model(model)[1])
    runs = []
    with Progress(console=Console(stderr=True), transient=True) as bar:
        for k in range(real_runs):
            task = bar.add_task(
                f"serving {len(w)} requests on {model} (real run {k + 1}/{real_runs})", total=int(w.output.sum())
            )
            runs.append(
                serve(
                    w,
                    served,
                    cfg,
                    eng,
                    threads=threads,
                    on_iteration=lambda it, task=task: bar.advance(task, it.num_decode + it.num_prefill),
                    clock=clock,
                )
            )
    measured = average_runs(runs)
    simulated = run_sim(w, latency, cfg)
    v = compare(measured, simulated, latency)
    pred = [latency.iteration_latency(b.to_batch()) for b in measured.batches]
    return {
        "kind": "validation",
        "model": model,
        "workload": workload,
        "config": cfg.label(),
        "threads": threads,
        "clock": clock,
        "table": v.rows,
        "iteration_mape": v.iteration_mape,
        "real_runs": real_runs,
        "run_to_run_pct": request_spread(runs),
        "measured": {"ttft": measured.metrics.ttft, "tpot": measured.metrics.tpot, "e2e": measured.metrics.e2e},
        "simulated": {"ttft": simulated.metrics.ttft, "tpot": simulated.metrics.tpot, "e2e": simulated.metrics.e2e},
        "iterations": {"measured": np.array([it.end - it.start for it in measured.iterations]), "predicted": pred},
    }


def run_vllm_validation(
    model: str,
    db: Path,
    workload: str,
    max_seqs: int,
    max_tokens: int,
    block_size: int,
    kvcache_gb: int,
    threads: int,
    dtype: str,
    real_runs: int,
    warmup_runs: int = 1,
) -> dict:
    """`validate-serving --engine vllm`: the real `vllm serve` under vLLM's load generator vs the simulator
    running vLLM v1's scheduler (see :mod:`dooly.serve.vllm_serving`)."""
    from dooly.serve.vllm_serving import ServeConfig, validate, vllm_available
    from dooly.simulator import CachedLatency, parse_workload

    why = vllm_available()
    if why:
        raise DoolyError(why)
    w = parse_workload(workload)
    predictor, profiled_with = serving_latency_model(model, db, dtype, threads, "vllm", log=out.print)
    blocks = vllm_cpu_kv_blocks(model, kvcache_gb, block_size, dtype)
    longest = int((w.prompt + w.output).max())
    serve_cfg = ServeConfig(
        max_seqs,
        max_tokens,
        block_size,
        kvcache_gb,
        dtype,
        threads,
        max_model_len=max(256, -(-longest // block_size) * block_size),
    )
    log = Console(stderr=True).print
    payload = validate(
        model, w, serve_cfg, blocks, CachedLatency(predictor), real_runs, log=log, warmup_runs=warmup_runs
    )
    payload["workload"] = workload
    payload["profiled_with"] = profiled_with
    return payload


def print_validation(payload: dict) -> None:
    table = Table(
        "metric",
        "measured p50 ms",
        "sim p50 ms",
        "measured mean ms",
        "sim mean ms",
        "per-request MAPE",
        "p10-p90 error",
        title=f"{payload['model']}: {payload['workload']} ({payload['config']}, {payload['clock']} clock)",
    )
    for r in payload["table"]:
        table.add_row(
            r["metric"],
            _ms(r["measured_p50"]),
            _ms(r["simulated_p50"]),
            _ms(r["measured_mean"]),
            _ms(r["simulated_mean"]),
            f"{r['mape_pct']:.1f}%",
            f"{r['quantile_err_pct']:.1f}%",
        )
    out.print(table)
    noise = payload.get("run_to_run_pct") or {}
    if "iteration_metric" in payload:  # vLLM: no iteration timings, the clients' inter-token latencies instead
        spread = f" (runs apart {noise['itl']:.1f}%)" if "itl" in noise else ""
        out.print(f"iteration latency MAPE ({payload['iteration_metric']}): {payload['iteration_mape']:.1f}%{spread}")
    else:
        out.print(f"iteration latency MAPE (predictor vs the iterations that ran): {payload['iteration_mape']:.1f}%")
    if noise and payload.get("real_runs", 1) > 1:
        out.print(
            f"run-to-run spread of the {payload['real_runs']} real runs (noise floor): "
            f"TTFT {noise['ttft']:.1f}%  TPOT {noise['tpot']:.1f}% per request; "
            f"p10-p90 TTFT {noise['ttft_quantiles']:.1f}%  TPOT {noise['tpot_quantiles']:.1f}%"
        )
    adm = payload.get("admission_order")
    if adm and any(adm["requests_out_of_order"]):
        out.print(
            f"vLLM's front end admitted {'/'.join(map(str, adm['requests_out_of_order']))} requests (per run) "
            f"out of arrival order; simulated in the order it admitted them: TTFT {adm['ttft_mape']:.1f}%  "
            f"TPOT {adm['tpot_mape']:.1f}%  iteration {adm['iteration_mape']:.1f}% per-request MAPE"
        )
    if payload.get("profiled_with"):
        out.print(f"ops profiled with: {payload['profiled_with']}")


@app.command("validate-serving")
def validate_serving(
    model: str = typer.Argument(..., help="Model name (zoo) or config path, as profiled."),
    db: Path = typer.Option(..., "--db", help="Profile database (SQLite)."),
    workload: str = typer.Option("poisson:n=24,rate=4,prompt=16-128,output=8-24,seed=0", help=SIM_HELP),
    max_seqs: int = typer.Option(8, "--max-num-seqs", help="Most requests in one iteration."),
    max_tokens: int = typer.Option(512, "--max-num-batched-tokens", help="Token budget of one iteration."),
    chunked: bool = typer.Option(False, "--chunked-prefill/--no-chunked-prefill", help="Split long prompts."),
    block_size: int = typer.Option(None, help="KV-cache block size in tokens (default 16; 128 for --engine vllm)."),
    kv_blocks: int = typer.Option(4096, help="KV-cache blocks (HF engine; vLLM's follow from --cpu-kvcache-gb)."),
    cpu_kvcache_gb: int = typer.Option(1, "--cpu-kvcache-gb", help=KVCACHE_HELP),
    threads: int = typer.Option(
        None, help="torch threads for the real engine (default: DOOLY_THREADS or 1, as the profiler)."
    ),
    dtype: str = typer.Option("bfloat16", help="Engine dtype (match the profiling run)."),
    clock: str = typer.Option(
        None, help="wall, or thread (serving thread's CPU time); default: the clock the profiles were taken with."
    ),
    real_runs: int = typer.Option(
        2, "--real-runs", min=1, help="Serve the workload this many times; their spread is the noise floor."
    ),
    warmup_runs: int = typer.Option(
        1, "--warmup-runs", min=0, help="--engine vllm: serve the workload this many times first, unscored."
    ),
    engine: str = typer.Option(DEFAULT_ENGINE, "--engine", help=_ENGINE_HELP),
    device: str = typer.Option("cpu", "--device", help="hf-eager: cpu or cuda, as profiled (vLLM: its CPU backend)."),
) -> None:
    """Serve a workload with the real engine and compare TTFT/TPOT with the simulator's prediction."""
    from dooly.profile import default_threads
    from dooly.report import save_result

    threads = threads if threads is not None else default_threads()
    if engine == "vllm":
        if device != "cpu":
            raise DoolyError("validate-serving --engine vllm serves with vLLM's CPU backend; drop --device")
        payload = run_vllm_validation(
            model,
            db,
            workload,
            max_seqs,
            max_tokens,
            block_size or VLLM_BLOCK_SIZE,
            cpu_kvcache_gb,
            threads,
            dtype,
            real_runs,
            warmup_runs,
        )
        print_validation(payload)
        path = save_result(db, f"validation-{Path(model).stem}-vllm{max_tokens}-seqs{max_seqs}", payload)
        out.print(f"result: {path}")
        return
    if clock is None:
        from dooly.profile import default_clock

        clock = default_clock(device, threads)
    cfg = sched_config(max_seqs, max_tokens, chunked, block_size or 16, kv_blocks)
    payload = run_validation(model, db, workload, cfg, threads, dtype, clock, real_runs, engine, device)
    print_validation(payload)
    mode = "chunked" if chunked else "whole"
    path = save_result(db, f"validation-{Path(model).stem}-{mode}{max_tokens}-seqs{max_seqs}", payload)
    out.print(f"result: {path}")


@app.command("export-vidur")
def export_vidur_cmd(
    model: str = typer.Argument(..., help="Model name (zoo) or config path, as traced and profiled."),
    db: Path = typer.Option(..., "--db", help="Profile database (SQLite)."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for mlp.csv and attention.csv."),
    dtype: str = typer.Option("bfloat16", help="Engine dtype the model was profiled with."),
) -> None:
    """Write MODEL's profiles as Vidur profiling CSVs (data/profiling/compute/<device>/<model>/)."""
    from dooly.vidur_export import export_vidur

    mlp, attn = export_vidur(model, db, output, dtype=dtype)
    out.print(f"wrote {mlp} and {attn}")


@app.command()
def report(
    db: Path = typer.Option(..., "--db", help="Profile database (SQLite)."),
    output: Path = typer.Option(Path("dooly-report.html"), "-o", "--output", help="HTML file to write."),
    results: Path | None = typer.Option(None, help="Results directory (default: beside the DB)."),
) -> None:
    """Write one self-contained HTML report: savings, validation, simulated latency."""
    from dooly.report import write_report

    path = write_report(db, output, results)
    out.print(f"report: {path}")


@app.command()
def demo(
    workdir: Path = typer.Option(Path("out/dooly-demo"), help="Where the DB, results and report go."),
    quick: bool = typer.Option(False, help="Smallest settings (a smoke run)."),
    grid: str = typer.Option("default", help="Profiler grid: default (accurate) or tiny (faster, coarse)."),
) -> None:
    """Run dooly end to end on the zoo's small models: trace, profile with reuse, validate, simulate, report."""
    from dooly.demo import run_demo

    path = run_demo(workdir, quick=quick, grid=grid)
    out.print(f"[bold]dooly report:[/] {path}")
