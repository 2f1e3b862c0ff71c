"""The pipeline end to end on tiny traces (Markov only), the report, and the CLI commands."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tracesynth.cli import app
from tracesynth.errors import TraceSynthError
from tracesynth.evaluate.pipeline import generator_specs, load_config, run_pipeline
from tracesynth.io import read_trace
from tracesynth.report import load_results, write_report
from tracesynth.resources import configs_dir
from tracesynth.trace import Trace


def workload_trace(path: Path, names: list[str], seed: int, n: int = 1200) -> Path:
    rng = np.random.default_rng(seed)
    # a noisy cycle over the workload's own events, syscalls paired on one thread
    base = np.resize(np.arange(len(names)), n)
    ev = np.where(rng.random(n) < 0.1, rng.integers(0, len(names), n), base)
    Trace.from_columns(
        ts=np.cumsum(rng.integers(1, 1000, n)),
        event=[names[i] for i in ev],
        cpu=[0] * n,
        tid=[1] * n,
        comm=["w"] * n,
        metadata={"workload": path.stem},
    ).save(path)
    return path


@pytest.fixture
def tiny_config(tmp_path: Path) -> dict:
    a = workload_trace(tmp_path / "alpha.parquet", ["syscall_entry_read", "syscall_exit_read", "sched_switch", "x"], 0)
    b = workload_trace(tmp_path / "beta.parquet", ["syscall_entry_write", "syscall_exit_write", "y", "z", "w"], 1)
    return {
        "name": "tiny",
        "traces": [str(a), {"path": str(b), "workload": "beta"}],
        "context": 16,
        "seeds": [0, 1],
        "repair": False,
        "generators": {"markov": {"kind": "markov", "order": 2}},
        "classifier": {"embed": 8, "hidden": 8, "steps": 8, "batch": 16},
        "max_train_windows": 300,
        "max_test_windows": 100,
        "discriminator": {"max_windows": 200},
        "scarce": {"budgets": [0.2, 1.0], "multipliers": [1], "workloads": ["alpha"]},
    }


def test_pipeline_writes_tables_and_report(tiny_config: dict, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "out"
    report = run_pipeline(tiny_config, out)
    assert report == out / "report.html" and report.is_file()
    res = load_results(out)
    t = res["tables"]
    assert {r["regime"] for r in t["regimes"]} == {"real", "half_real", "mix_unrepaired", "synthetic_only"}
    assert {r["seed"] for r in t["regimes"]} == {0, 1}
    assert {r["train_on"] for r in t["workload_id"]} == {"real", "markov"}
    assert all(0.0 <= r["auc"] <= 1.0 and 0.0 <= r["auc_reference"] <= 1.0 for r in t["discriminator"])
    # every synthetic AUC comes with its same-period real-vs-real reference, in the tables and the Markdown
    assert {(r["workload"], r["variant"]) for r in t["discriminator"]} == {("alpha", "raw"), ("beta", "raw")}
    assert "auc_reference" in (out / "tables" / "discriminator_summary.csv").read_text().splitlines()[0]
    assert "auc_reference" in (out / "results.md").read_text()
    assert {r["budget"] for r in t["scarce"]} == {0.2, 1.0}
    assert (out / "tables" / "regimes_summary.csv").is_file() and "Macro-F1" in (out / "results.md").read_text()
    html = report.read_text()
    assert html.count("data:image/png;base64,") >= 5 and "http://" not in html.replace("http://www.w3.org", "")
    # re-rendering from results.json (NaNs stored as null) works too; per-workload plots left out for speed
    res["plots"] = {}
    assert write_report(res, tmp_path / "again.html").stat().st_size > 10_000


def test_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text('{"nonsense": 1}')
    with pytest.raises(TraceSynthError, match="unknown config key"):
        load_config(bad)
    bad.write_text("{not json")
    with pytest.raises(TraceSynthError, match="c.json"):
        load_config(bad)
    with pytest.raises(TraceSynthError):
        load_results(tmp_path)


def test_cli_report_and_evaluate(tiny_config: dict, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert r.exit_code != 0 and isinstance(r.exception, TraceSynthError)
    real = Path(tiny_config["traces"][0])
    r = runner.invoke(app, ["evaluate", str(real), str(real)])
    assert r.exit_code == 0, r.output
    assert "jsd_event" in r.output and "copied_window_share" in r.output
    for cmd in ("evaluate", "report", "run", "experiment"):
        assert runner.invoke(app, [cmd, "--help"]).exit_code == 0
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"traces": ["/nonexistent.parquet"]}))
    r = runner.invoke(app, ["run", str(cfg), "-o", str(tmp_path / "o")])
    assert r.exit_code != 0 and not (tmp_path / "o").exists()


def test_sweep_rows_carry_reference_and_real_baselines(tiny_config: dict, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = dict(tiny_config, seeds=[0], generators={"markov": {"kind": "markov", "order": 2}})
    cfg["traces"] = cfg["traces"][:1]
    cfg.update(
        discriminator={"enabled": False, "max_windows": 200},
        regimes={"enabled": False},
        workload_id={"enabled": False},
        scarce={"enabled": False},
        sweep={"name": "order", "generator": "markov", "variants": {"o1": {"order": 1}, "o3": {"order": 3}}},
    )
    run_pipeline(cfg, tmp_path / "out")
    t = load_results(tmp_path / "out")["tables"]
    assert not t["generators"]  # the swept generator is fitted once per variant, not once more as the base
    rows = t["sweep"]
    assert {(r["workload"], r["variant"]) for r in rows} == {("alpha", v) for v in ("real", "half_real", "o1", "o3")}
    for r in rows:
        assert 0.0 <= r["macro_f1"] <= 1.0
        if r["variant"] in ("o1", "o3"):
            assert 0.0 <= r["auc"] <= 1.0 and 0.0 <= r["auc_reference"] <= 1.0 and r["fit_s"] >= 0
    # one reference per workload and seed, shared by the variants
    assert len({r["auc_reference"] for r in rows if r["variant"] in ("o1", "o3")}) == 1


def test_a_sweep_over_two_generators_sets_each_networks_config(tiny_config: dict, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    net = {"d_model": 16, "n_layers": 1, "n_heads": 2, "batch_size": 4, "steps": 3, "overlap": 4, "chains": 2}
    cfg = dict(tiny_config, seeds=[0], generators={"ar": {"kind": "ar", "config": dict(net)},
                                                   "masked": {"kind": "masked", "config": dict(net, sample_steps=2)}})
    cfg["traces"] = cfg["traces"][:1]
    cfg.update(discriminator={"enabled": False, "max_windows": 200}, regimes={"enabled": False},
               workload_id={"enabled": False}, scarce={"enabled": False},
               sweep={"name": "context", "generator": ["ar", "masked"],
                      "variants": {"L16": {"context": 16}, "L32": {"context": 32}}})
    run_pipeline(cfg, tmp_path / "out")
    res = load_results(tmp_path / "out")["tables"]
    assert not res["generators"]  # each swept generator is fitted only as its variants
    windows = {r["variant"]: r["train_windows"] for r in res["sweep"] if r.get("train_windows")}
    assert set(windows) == {"ar:L16", "ar:L32", "masked:L16", "masked:L32"}
    for g in ("ar", "masked"):  # the variant's context reached the network's config: longer windows, fewer
        assert windows[f"{g}:L32"] < windows[f"{g}:L16"]


def test_evaluate_against_an_empty_real_trace_is_one_error(tiny_config: dict, tmp_path: Path) -> None:
    Trace.from_columns([], []).save(tmp_path / "empty.parquet")
    real = Path(tiny_config["traces"][0])
    r = CliRunner().invoke(app, ["evaluate", str(tmp_path / "empty.parquet"), str(real)])
    assert isinstance(r.exception, TraceSynthError) and "empty.parquet: the real trace has no events" in str(
        r.exception
    )
    # an empty synthetic trace scores n/a rather than failing
    r = CliRunner().invoke(app, ["evaluate", str(real), str(tmp_path / "empty.parquet")])
    assert r.exit_code == 0 and "n/a" in r.output, r.output


def test_unknown_generator_kind_fails_before_any_work(tiny_config: dict, tmp_path: Path) -> None:
    cfg = dict(tiny_config, generators={"markov": {"kind": "markov"}, "g": {"kind": "gan"}})
    with pytest.raises(TraceSynthError, match="unknown generator kind 'gan'"):
        run_pipeline(cfg, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_unknown_regime_is_one_clear_error(tiny_config: dict, tmp_path: Path) -> None:
    with pytest.raises(TraceSynthError, match="unknown regime"):
        run_pipeline(dict(tiny_config, regimes={"only": ["real", "mixed_up"]}), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_pipeline_samples_a_saved_model_without_fitting_it(tiny_config: dict, tmp_path: Path) -> None:
    """A generator spec with "load" (as the demo's shipped models/all) is sampled per workload, not fitted,
    and stays out of the scarce-data curve (it learned more than any budget)."""
    from tracesynth.generators.ar import ARConfig, Autoregressive

    torch.set_num_threads(1)
    traces = [read_trace(p if isinstance(p, str) else p["path"]) for p in tiny_config["traces"]]
    cfg = ARConfig(context=16, d_model=16, n_layers=1, n_heads=2, steps=3, conditional=True, chains=2)
    Autoregressive(cfg).fit(traces).save(tmp_path / "model")
    gens = {"markov": {"kind": "markov", "order": 2}, "ar": {"kind": "ar", "load": str(tmp_path / "model")}}
    run_pipeline(dict(tiny_config, seeds=[0], generators=gens), tmp_path / "out")
    res = load_results(tmp_path / "out")
    t = res["tables"]
    assert {r["generator"] for r in t["discriminator"]} == {"markov", "ar"}
    assert {r["train_on"] for r in t["workload_id"]} == {"real", "markov", "ar"}
    assert {r["generator"] for r in t["scarce"]} == {"-", "markov"}
    ar_fit = [r for r in t["generators"] if r["generator"] == "ar"]
    assert len(ar_fit) == 2 and all(r["fit_s"] < 5 for r in ar_fit)  # loaded, not trained
    # a spec whose kind is not the saved model's fails before any work
    bad = dict(tiny_config, generators={"m": {"kind": "masked", "load": str(tmp_path / "model")}})
    with pytest.raises(TraceSynthError, match="is of kind ar, not masked"):
        run_pipeline(bad, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


def test_demo_retrain_fits_the_saved_models_config_per_workload(tmp_path: Path) -> None:
    """`tracesynth demo --retrain S` turns a "load" spec into a fit of the same network for S seconds."""
    from tracesynth.cli.demo import _retrain_config
    from tracesynth.generators.ar import ARConfig, Autoregressive

    trace = read_trace(workload_trace(tmp_path / "alpha.parquet", ["a", "b", "c"], 0))
    cfg = ARConfig(context=16, d_model=16, n_layers=1, n_heads=2, steps=2, conditional=True)
    Autoregressive(cfg).fit([trace]).save(tmp_path / "m")
    got = _retrain_config({"_base": str(tmp_path)}, "m", 7.0)
    assert got["d_model"] == 16 and got["context"] == 16 and got["time_limit"] == 7.0
    assert got["conditional"] is False and got["steps"] >= 10**9
    with pytest.raises(TraceSynthError, match="cannot read the model config"):
        _retrain_config({"_base": str(tmp_path)}, "nothing-here", 7.0)


def test_demo_without_the_checkpoint_says_what_to_do(tiny_config: dict, tmp_path: Path) -> None:
    cfg = dict(tiny_config, generators={"ar": {"kind": "ar", "load": "no-such-dir/all"}})
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["demo", "--config", str(path), "-o", str(tmp_path / "out")])
    # the CLI's entry point prints a TraceSynthError as one line (tests/tracesynth/test_cli_io.py)
    assert isinstance(res.exception, TraceSynthError) and "--retrain SECONDS" in str(res.exception)
    assert "no-such-dir/all: the shipped checkpoint is not here" in str(res.exception)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(p.stem for p in configs_dir().glob("*.json")))
def test_shipped_configs_build_their_generators(name: str) -> None:
    """Every config the package ships loads and builds each generator it names (a typo fails here, not
    minutes into an experiment)."""
    cfg = load_config(configs_dir() / f"{name}.json")
    if any(spec.get("kind") == "sdv_par" for spec in cfg["generators"].values()):
        from tracesynth.generators.sdv_par import sdv_available

        if sdv_available():
            pytest.skip(f"{name} needs SDV: {sdv_available()}")
    specs = generator_specs(cfg)
    assert specs and all(spec["kind"] for spec in specs.values())
