"""The generator registry, and the small shared helpers (vocabularies, JSD, JSON values, table text)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from tracesynth.cli import app
from tracesynth.divergence import jsd
from tracesynth.errors import TraceSynthError
from tracesynth.generators import KINDS, Generator, get_kind, load_generator, make_generator, saved_kind
from tracesynth.generators.markov import MarkovChain
from tracesynth.generators.sdv_par import sdv_available
from tracesynth.jsonable import jsonable
from tracesynth.report import render_html, results_markdown
from tracesynth.tables import cell, html_table, markdown_table, mean_std
from tracesynth.trace import Trace
from tracesynth.vocab import Vocab


def cycle(n: int = 400) -> Trace:
    names = ("syscall_entry_read", "syscall_exit_read", "sched_switch")
    return Trace.from_columns(
        ts=np.arange(n) * 10, event=[names[i % 3] for i in range(n)], cpu=[0] * n, tid=[5] * n, comm=["w"] * n
    )


# -- registry -------------------------------------------------------------------------------------
def test_registry_builds_each_kind_behind_the_protocol() -> None:
    gen = make_generator({"kind": "markov", "order": 2})
    assert isinstance(gen, MarkovChain) and gen.order == 2 and isinstance(gen, Generator)
    assert gen.n_params is None  # nothing learned yet
    gen.fit([cycle()])
    # one table entry per (context, next event) seen; a 3-cycle: 3 at order 0, 3 + the start at order 1,
    # 3 + 2 start-padded at order 2
    assert gen.n_params == 3 + 4 + 5 and gen.fit_info == {}
    diffusion = make_generator({"kind": "diffusion", "config": {"context": 64, "d_model": 32}})
    assert diffusion.config.context == 64 and isinstance(diffusion, Generator) and diffusion.n_params is None
    masked = make_generator({"kind": "masked", "config": {"context": 64, "d_model": 32, "n_heads": 2}})
    assert masked.config.overlap == 16 and isinstance(masked, Generator) and masked.n_params is None
    with pytest.raises(TraceSynthError, match="masked diffusion config"):
        make_generator({"kind": "masked", "config": {"width": 3}})
    # a kind's config (what `tracesynth fit` builds) makes the generator a spec of the same options makes
    chain = make_generator(get_kind("markov").config({"order": 2}))
    assert isinstance(chain, MarkovChain) and chain.order == 2 and make_generator({"kind": "markov"}).order == 4
    assert make_generator(get_kind("ar").config({"steps": 5})).config == make_generator(
        {"kind": "ar", "config": {"steps": 5}}).config
    with pytest.raises(TraceSynthError, match="not a generator config or spec: int"):
        make_generator(3)
    known = r"\(known: diffusion, masked, ar, block, markov, sdv_par\)"
    with pytest.raises(TraceSynthError, match=r"unknown generator kind 'gan' " + known):
        make_generator({"kind": "gan"})
    with pytest.raises(TraceSynthError, match="unknown generator kind None"):
        make_generator({})


@pytest.mark.skipif(sdv_available() is None, reason="sdv is installed")
def test_sdv_par_without_sdv_says_how_to_install_it() -> None:
    with pytest.raises(TraceSynthError, match="pip install sdv"):
        make_generator({"kind": "sdv_par"})


def test_load_generator_reads_any_saved_kind(tmp_path: Path) -> None:
    m = make_generator({"kind": "markov", "order": 2}).fit([cycle()])
    m.save(tmp_path / "m")
    assert saved_kind(tmp_path / "m") is KINDS["markov"]
    back = load_generator(tmp_path / "m")
    assert isinstance(back, MarkovChain) and back.sample(100, seed=1) == m.sample(100, seed=1)


def test_saved_kind_errors_name_the_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceSynthError, match="absent: no such model directory"):
        saved_kind(tmp_path / "absent")
    (tmp_path / "d").mkdir()
    with pytest.raises(TraceSynthError, match="d: not a tracesynth model: missing config.json"):
        saved_kind(tmp_path / "d")
    for text in ("[]", "null", '{"kind": "gan"}'):
        (tmp_path / "d" / "config.json").write_text(text)
        with pytest.raises(TraceSynthError, match="d: config.json is not that of a saved generator"):
            saved_kind(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{")
    with pytest.raises(TraceSynthError, match="d: bad config.json"):
        saved_kind(tmp_path / "d")


def test_cli_fits_and_samples_a_markov_chain(tmp_path: Path) -> None:
    cycle().save(tmp_path / "real.parquet")
    runner = CliRunner()
    res = runner.invoke(app, ["fit", str(tmp_path / "real.parquet"), "-o", str(tmp_path / "m"), "--kind", "markov"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "s.parquet"
    res = runner.invoke(app, ["sample", str(tmp_path / "m"), "--events", "90", "-o", str(out), "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert Trace.load(out) == MarkovChain.load(tmp_path / "m").sample(90, seed=3)
    res = runner.invoke(app, ["sample", str(tmp_path / "m"), "--events", "90", "-o", str(out), "--guide", "kernel"])
    assert res.exit_code == 0, res.output
    assert Trace.load(out) == MarkovChain.load(tmp_path / "m").sample(90, seed=0, guide="kernel")
    # a diffusion-only option is refused, not ignored, and nothing is written
    res = runner.invoke(
        app,
        ["sample", str(tmp_path / "m"), "--events", "9", "-o", str(tmp_path / "x.parquet")]
        + [
            "--sampler",
            "ddim",
        ],
    )
    assert isinstance(res.exception, TraceSynthError) and "--sampler does not apply to a markov model" in str(
        res.exception
    )
    # no empty trace for a count of nothing
    res = runner.invoke(app, ["sample", str(tmp_path / "m"), "--events", "0", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code == 2 and "--events" in res.output
    assert not (tmp_path / "x.parquet").exists()
    res = runner.invoke(app, ["fit", str(tmp_path / "real.parquet"), "-o", str(tmp_path / "g"), "--kind", "gan"])
    assert isinstance(res.exception, TraceSynthError) and not (tmp_path / "g").exists()


# -- helpers ----------------------------------------------------------------------------------------
def test_jsd_bounds_and_empty_input() -> None:
    assert jsd(np.array([1, 2, 3]), np.array([2, 4, 6])) == 0.0
    assert math.isclose(jsd(np.array([1, 0]), np.array([0, 5])), 1.0)
    assert 0.0 < jsd(np.array([3, 1]), np.array([1, 3])) < 1.0
    # an empty side has no distribution: NaN, not the 0.5 an epsilon in the denominator gives
    assert math.isnan(jsd(np.zeros(3), np.array([1, 2, 3])))
    assert math.isnan(jsd(np.array([1.0]), np.zeros(1))) and math.isnan(jsd(np.zeros(0), np.zeros(0)))


def test_vocab_grows_from_batches_and_looks_up_without_growing() -> None:
    v = Vocab(nulls=["<unknown>"])
    a = v.grow(pa.array(["x", None, "y", "x", "<unknown>"]).dictionary_encode())
    b = v.grow(pa.array(["y", "z"]))
    assert a.tolist() == [0, -1, 1, 0, -1] and b.tolist() == [1, 2] and v.values == ["x", "y", "z"]
    codes = np.array([2, -1, 0, 1])
    assert v.lookup(codes, ["x", "q", "z"], default=7).tolist() == [2, 7, 0, 7]
    assert len(v) == 3 and "q" not in v


def test_jsonable_writes_strict_json() -> None:
    doc = {1: np.int64(3), "a": (np.float32(0.5), math.nan, -math.inf), "b": np.arange(2), "c": np.bool_(True)}
    text = json.dumps(jsonable(doc), allow_nan=False)
    assert json.loads(text) == {"1": 3, "a": [0.5, None, None], "b": [0, 1], "c": True}


def test_markdown_and_html_print_the_same_digits() -> None:
    row = {"workload": "w", "regime": "real", "generator": "-", "macro_f1": 0.912345, "macro_f1_std": 0.004567}
    row.update(accuracy=math.nan, accuracy_std=0.0, n=2)
    assert mean_std(row, "macro_f1") == "0.9123 ± 0.0046" and mean_std(row, "accuracy") == "n/a"
    assert cell(1234.5678) == "1235" and cell(None) == cell(math.nan) == "n/a" and cell(3) == "3"
    empty = {k: [] for k in ("discriminator_summary", "workload_id_summary", "fidelity", "scarce_summary")}
    results = {"config": {"name": "t"}, "tables": {**empty, "regimes_summary": [row], "generators": []}}
    assert "| w | real | - | 0.9123 ± 0.0046 | n/a | 2 |" in results_markdown(results)
    assert "<td>0.9123 ± 0.0046</td><td>n/a</td>" in render_html(results)
    assert markdown_table([{"a": 1.0, "b": "<x>"}]) == "| a | b |\n|---|---|\n| 1 | <x> |\n"
    assert (
        html_table([{"a": 1.0, "b": "<x>"}])
        == "<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>&lt;x&gt;</td></tr></table>"
    )


def test_report_does_not_import_evaluation() -> None:
    # one-way: the pipeline (tracesynth.evaluate) renders through tracesynth.report, never the reverse
    code = "import sys, tracesynth.report; print(sorted(m for m in sys.modules if m.startswith('tracesynth.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "tracesynth.report" in out and "tracesynth.evaluate" not in out and "tracesynth.generators" not in out
