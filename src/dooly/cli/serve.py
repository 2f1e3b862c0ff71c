"""`dooly simulate`, `validate-serving`, `export-vidur`, `report` and `demo`: serving questions from profiles."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dooly import api, layout_sweep
from dooly.cli.app import app
from dooly.engines import DEFAULT_ENGINE

out = Console()


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:.1f}"


_ENGINE_HELP = (
    "Inference engine: hf-eager, or vllm (the simulator runs vLLM v1's scheduler; validate-serving serves with "
    "the real `vllm serve`; the ops' profiles are vLLM's when the DB has them, else hf-eager's)."
)


KVCACHE_HELP = "vLLM CPU backend: KV-cache GiB (VLLM_CPU_KVCACHE_SPACE); the KV blocks follow from it."


SIM_HELP = "Workload: a CSV/JSONL trace or a generator spec such as poisson:n=64,rate=2,prompt=32-256,output=16"


ROUTER_HELP = (
    "Global scheduler across replicas: round_robin, random (seeded by --router-seed) or least_outstanding "
    "(fewest requests queued or running at arrival)."
)


@contextmanager
def _bars() -> Iterator[api.TaskFn]:
    """Transient progress bars on stderr, so stdout holds only the answer."""
    with Progress(console=Console(stderr=True), transient=True) as bar:

        def task(title: str, total: int) -> Callable[[int], None]:
            t = bar.add_task(title, total=total)
            return lambda n: bar.advance(t, n)

        yield task


def _hooks() -> api.ServeHooks:
    """The answer's lines on stdout; the progress (lines and bars) on stderr."""
    return api.ServeHooks(report=out.print, log=Console(stderr=True).print, bars=_bars)


@app.command()
def simulate(
    model: str = typer.Argument(..., help="Model name (zoo) or config path, as profiled."),
    db: Path = typer.Option(..., "--db", help="Profile database (SQLite)."),
    workload: str = typer.Option(api.SIM_WORKLOAD, help=SIM_HELP),
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
        None,
        "--memory-gb",
        help="Memory of each device in GiB (a replica of --tp x --pp devices has that many): derive the KV blocks from "
        "it as vLLM does; with --sweep-layouts, a layout whose weights and KV do not fit is marked so.",
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
    sweep: bool = typer.Option(
        False,
        "--sweep",
        help="Sweep the scheduler config (max tokens, max seqs, chunked prefill) of one device layout "
        "(--sweep-layouts sweeps the layouts instead).",
    ),
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
    tp: int = typer.Option(
        1, "--tp", min=1, help="Tensor-parallel devices per replica (vllm; profiled with `dooly profile --tp`)."
    ),
    pp: int = typer.Option(
        1,
        "--pp",
        min=1,
        help="Pipeline stages per replica, each of --tp devices (vllm): up to --pp batches in flight, as vLLM v1.",
    ),
    sweep_layouts: bool = typer.Option(
        False,
        "--sweep-layouts",
        help="Simulate every layout of --devices devices (TP x PP x replicas, vllm; unprofiled ranks priced from "
        "shape) at the scheduler config given, and pick the one that meets the SLO at the highest throughput per "
        "device (--sweep sweeps the scheduler config of one layout instead).",
    ),
    devices: int = typer.Option(8, "--devices", min=1, help="Devices the layout sweep divides (--sweep-layouts)."),
) -> None:
    """Simulate serving MODEL from its profiles; with --sweep, find the best config under an SLO; with
    --sweep-layouts, the best device layout."""
    if sweep_layouts:
        if sweep:
            raise typer.BadParameter("--sweep and --sweep-layouts sweep different things: give one")
        kw = {"workload": workload, "max_seqs": max_seqs, "max_tokens": max_tokens, "block_size": block_size}
        kw |= {"memory_gb": memory_gb, "gpu_util": gpu_util, "kv_cache_dtype": kv_cache_dtype, "kv_blocks": kv_blocks}
        kw |= {"activation_gb": activation_gb, "router": router, "router_seed": router_seed, "slo_ttft": slo_ttft}
        kw |= {"slo_tpot": slo_tpot, "dtype": dtype, "engine": engine}
        print_layouts(layout_sweep.sweep_layouts(model, db, devices=devices, **kw, hooks=_hooks()))
        return
    kw = {"max_seqs": max_seqs, "max_tokens": max_tokens, "chunked": chunked, "block_size": block_size}
    kw |= {"cpu_kvcache_gb": cpu_kvcache_gb, "kv_blocks": kv_blocks, "memory_gb": memory_gb, "gpu_util": gpu_util}
    kw |= {"kv_cache_dtype": kv_cache_dtype, "activation_gb": activation_gb, "replicas": replicas, "router": router}
    kw |= {"router_seed": router_seed, "sweep": sweep, "slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "dtype": dtype}
    kw |= {"engine": engine, "shape": shape, "output": output, "tp": tp, "pp": pp}
    study = api.simulate(model, db, workload=workload, **kw, hooks=_hooks())
    if sweep:
        print_sweep(study)
    else:
        _print_study(study, model, len(study.result.requests))
    if output:
        out.print(f"sweep table: {output}" if sweep else f"per-request metrics: {output}")


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}%"


def print_layouts(sweep) -> None:  # type: ignore[no-untyped-def]
    """The layout sweep's table (one row per layout, refused and not fitting ones with why) and its pick."""
    top = sweep.best
    table = Table(
        "layout", "fits", "KV blocks", "TTFT p90 s", "TPOT p90 s", "tok/s", "tok/s/device", "coll. prefill",
        "coll. decode", "SLO", box=None,
        title=f"{sweep.model} on {sweep.devices} devices: {sweep.workload} ({sweep.config} per replica)",
    )  # fmt: skip
    for p in sweep.points:
        s = p.summary
        name = p.layout.label() + (f" ({p.stages})" if p.stages else "")
        if not p.fits:
            verdict = "vLLM refuses" if p.reason.startswith("vLLM") else "does not fit"
            table.add_row(name, "no", "-", "-", "-", "-", "-", "-", "-", verdict)
            continue
        if s is None:
            table.add_row(name, "yes", str(p.kv_blocks), "-", "-", "-", "-", "-", "-", "n/a")
            continue
        verdict = ("pick" if p is top else "meets") if p.meets_slo else "misses"
        table.add_row(
            name, "yes", str(p.kv_blocks), f"{s.ttft['p90']:.2f}", f"{s.tpot['p90']:.3f}", f"{s.throughput_tokens:.1f}",
            f"{p.throughput_per_device:.1f}", _pct(p.collectives_prefill), _pct(p.collectives_decode), verdict,
        )  # fmt: skip
    out.print(table)
    for p in sweep.points:
        if p.reason:
            out.print(f"{p.layout.label()}: {p.reason}")
    out.print("coll. prefill / decode: the collectives' share of a replica's operator time in a full prefill / decode")
    for note in sweep.notes:
        out.print(f"collectives: {note}")
    if top is None:
        out.print(f"no layout meets {sweep.slo.describe()}")
    else:
        out.print(
            f"pick under {sweep.slo.describe()}: [bold]{top.layout.label()}[/] "
            f"({top.throughput_per_device:.1f} tok/s per device, {top.summary.throughput_tokens:.1f} tok/s in all, "
            f"TTFT p90 {_ms(top.summary.ttft['p90'])} ms, TPOT p90 {_ms(top.summary.tpot['p90'])} ms)"
        )


def _print_study(study, model: str, n_requests: int) -> None:  # type: ignore[no-untyped-def]
    """The summary of one simulated configuration (and how the router spread the requests over replicas)."""
    cfg, res = study.kv.config, study.result
    title = f"{model}: {n_requests} requests, {cfg.label()} kv_blocks={cfg.num_kv_blocks}"
    if study.replicas > 1:
        title += f", {study.replicas} replicas ({study.router})"
    print_summary(res.summary, title)
    if study.replicas > 1:
        out.print(f"requests per replica: {', '.join(map(str, res.replica_counts()))}")


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


def _print_percentiles(payload: dict) -> None:
    """The headline: each metric's p50/p90/p99 as `vllm bench serve` prints them, measured (the median of the
    real runs' percentiles) vs simulated, the error at each and averaged, and the runs' spread beside it."""
    scores = payload.get("percentiles")
    if not scores:
        return
    ps = "/".join(f"p{p:g}" for p in next(iter(scores.values()))["percentiles"])
    table = Table(
        "metric",
        f"measured {ps} ms",
        f"simulated {ps} ms",
        f"error {ps}",
        "mean error",
        "runs apart",
        title=f"{payload['model']}: {payload['workload']} ({payload['config']}, {payload['clock']} clock)",
    )
    for metric, s in scores.items():
        table.add_row(
            metric.upper(),
            " / ".join(_ms(x) for x in s["measured"]),
            " / ".join(_ms(x) for x in s["simulated"]),
            " / ".join(f"{x:.1f}%" for x in s["error_pct"]),
            f"{s['mean_error_pct']:.1f}%",
            "-" if not math.isfinite(s["mean_spread_pct"]) else f"{s['mean_spread_pct']:.1f}%",
        )
    out.print(table)
    out.print(
        f"percentile error ({ps} averaged): "
        + "  ".join(f"{m.upper()} {s['mean_error_pct']:.1f}%" for m, s in scores.items())
    )


def print_validation(payload: dict) -> None:
    _print_percentiles(payload)
    table = Table(
        "metric",
        "measured p50 ms",
        "sim p50 ms",
        "measured mean ms",
        "sim mean ms",
        "per-request MAPE",
        "p10-p90 error",
        title="per request, in arrival order (secondary: moved by the server's admission order, see README)"
        if payload.get("percentiles")
        else f"{payload['model']}: {payload['workload']} ({payload['config']}, {payload['clock']} clock)",
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
    workload: str = typer.Option(api.VALIDATE_WORKLOAD, help=SIM_HELP),
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
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="vllm: serve a tensor-parallel replica (--tensor-parallel-size), --threads cores per rank; simulated as "
        "`dooly simulate --tp` (after `dooly profile --engine vllm --tp N`).",
    ),
    pp: int = typer.Option(
        1,
        "--pp",
        min=1,
        help="vllm: pipeline stages of the replica (--pipeline-parallel-size), each of --tp ranks; simulated as "
        "`dooly simulate --pp` (after `dooly profile --engine vllm --pp M --pp-stage S` for each stage).",
    ),
) -> None:
    """Serve a workload with the real engine and compare TTFT/TPOT with the simulator's prediction."""
    kw = {"max_seqs": max_seqs, "max_tokens": max_tokens, "chunked": chunked, "block_size": block_size}
    kw |= {"kv_blocks": kv_blocks, "cpu_kvcache_gb": cpu_kvcache_gb, "threads": threads, "dtype": dtype}
    kw |= {"clock": clock, "real_runs": real_runs, "warmup_runs": warmup_runs, "engine": engine, "device": device}
    payload, path = api.validate_serving(model, db, workload=workload, **kw, tp=tp, pp=pp, hooks=_hooks())
    print_validation(payload)  # the layout was said as the server came up
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
