"""Seeded mutation fuzzing of every tracesynth input format (issue 14).

Each case damages a copy of a real input (truncation, byte flips, bad UTF-8, huge numbers, CRLF,
line edits, emptied or deleted files, odd JSON values) and runs the command a user would run on
it. Every case must end with exit 0 or 1, no traceback, within a time limit (tools that stop
printing are given up on after TRACESYNTH_STALL_SECONDS, set low here), leave no output
behind on failure and no `.*.tmp` temporary at all, and warn where it skipped input it was given.

Cases run in this process through the real entry point (`tracesynth.cli.main`, fast: the imports
are paid once); the first case of each format also runs as a subprocess, the honest check that
stderr holds no "Traceback". The Markov baseline has no CLI: its load()/sample() API is fuzzed.

TRACESYNTH_FUZZ_CASES (default 8, as `make test` runs it) is the number of cases per format;
TRACESYNTH_FUZZ_SEED (default 0) changes the mutations. `make test-all` runs 200 per format, `make fuzz` 2000.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_run import tracesynth

from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = int(os.environ.get("TRACESYNTH_FUZZ_CASES", "8"))
SEED = int(os.environ.get("TRACESYNTH_FUZZ_SEED", "0"))
CASE_TIMEOUT = 60  # seconds; a case slower than this counts as a hang
STALL = 15  # TRACESYNTH_STALL_SECONDS for the readers: well inside CASE_TIMEOUT
needs_bt2 = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")
needs_perf = pytest.mark.skipif(shutil.which("perf") is None, reason="perf is not installed")


# -- mutations ------------------------------------------------------------------------------------
@dataclass
class Mutation:
    kind: str
    must_warn: str | None = None  # a regex the warnings must match when the command succeeds
    notes: list[str] = field(default_factory=list)


def _flip(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _bad_utf8(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80\x80"]) + data[i:]


def _huge_number(data: bytes, rng: random.Random) -> bytes:
    runs = [m.span() for m in re.finditer(rb"\d+", data[: 1 << 20])]
    if not runs:
        return data + b"99999999999999999999999"
    a, b = rng.choice(runs)
    big = rng.choice([b"99999999999999999999999", b"18446744073709551616", b"9223372036854775808", b"-" + b"9" * 30])
    return data[:a] + big + data[b:]


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)] if data else data


BYTE_MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "truncate": _truncate,
    "flip": _flip,
    "bad_utf8": _bad_utf8,
    "huge_number": _huge_number,
}


def mutate_text(data: bytes, rng: random.Random, ts_line: re.Pattern[bytes]) -> tuple[bytes, Mutation]:
    """A text trace: byte mutations plus line edits, CRLF, a garbage line, an oversized timestamp."""
    kind = rng.choice([*BYTE_MUTATIONS, "crlf", "delete_lines", "duplicate_line", "swap_lines", "garbage", "huge_ts"])
    if kind in BYTE_MUTATIONS:
        return BYTE_MUTATIONS[kind](data, rng), Mutation(kind)
    lines = data.split(b"\n")
    if kind == "crlf":
        return data.replace(b"\n", b"\r\n"), Mutation(kind)
    i = rng.randrange(len(lines))
    if kind == "delete_lines":
        del lines[i : i + rng.randint(1, 20)]
    elif kind == "duplicate_line":
        lines.insert(i, lines[i])
    elif kind == "swap_lines":
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "garbage":
        lines.insert(i, rng.choice([b"zz garbage line 12 [x] 3.4: q", b"\x00\x01binary\x02", b"[pid 1] what?"]))
        return b"\n".join(lines), Mutation(kind, must_warn="skipped")
    elif kind == "huge_ts":  # the timestamp of one event line beyond int64 ns: that line must be skipped
        events = [k for k, ln in enumerate(lines) if ts_line.search(ln)]
        k = rng.choice(events)
        lines[k] = ts_line.sub(lambda m: m.group(1) + b"99999999999999999999" + m.group(3), lines[k], count=1)
        return b"\n".join(lines), Mutation(kind, must_warn="skipped")
    return b"\n".join(lines), Mutation(kind)


def mutate_dir(root: Path, rng: random.Random, streams: str | None = None) -> Mutation:
    """A directory input (CTF trace, model): damage one file, or empty or delete one."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    target = rng.choice(files)
    kind = rng.choice([*BYTE_MUTATIONS, "empty", "delete"])
    rel = str(target.relative_to(root))
    # emptying or deleting a data stream file must be reported (metadata/index damage fails instead)
    is_stream = streams is not None and re.fullmatch(streams, target.name) is not None
    # a deleted stream is knowable when LTTng's index lists it or a higher-numbered stream remains
    # (perf CTF has no index: its last per-CPU stream may go unnoticed)
    knowable = kind == "empty" or (target.parent / "index" / f"{target.name}.idx").exists()
    if is_stream and not knowable:
        prefix, num = target.name.rsplit("_", 1)
        knowable = any(
            p.name.startswith(prefix + "_")
            and p.name.rsplit("_", 1)[1].isdigit()
            and int(p.name.rsplit("_", 1)[1]) > int(num)
            for p in target.parent.iterdir()
        )
    must = re.escape(target.name) if is_stream and kind in ("empty", "delete") and knowable else None
    if kind == "empty":
        target.write_bytes(b"")
    elif kind == "delete":
        target.unlink()
    else:
        target.write_bytes(BYTE_MUTATIONS[kind](target.read_bytes(), rng))
    return Mutation(f"{kind}:{rel}", must_warn=must)


_ODD_JSON = [None, [], {}, 0, -1, 1.5, "x", True, 10**30, 1e308, [1, 2]]


def mutate_model_json(root: Path, rng: random.Random) -> Mutation:
    """Set one key of a model's config.json/vocab.json (nested ones included) to an odd value."""
    path = rng.choice(sorted(root.glob("*.json")))
    doc = json.loads(path.read_text())
    if rng.random() < 0.15:
        path.write_text(json.dumps(rng.choice(_ODD_JSON)))
        return Mutation(f"replace:{path.name}")
    holder, key = doc, None
    while True:
        keys = list(holder) if isinstance(holder, dict) else list(range(len(holder)))
        if not keys:
            break
        key = rng.choice(keys)
        if isinstance(holder[key], dict | list) and holder[key] and rng.random() < 0.5:
            holder = holder[key]
            continue
        break
    if key is not None:
        holder[key] = rng.choice(_ODD_JSON)
    path.write_text(json.dumps(doc))
    return Mutation(f"json:{path.name}:{key}")


# -- running one case --------------------------------------------------------------------------------
class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def ring(signum, frame):  # noqa: ANN001
        raise _Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    code: int
    err: str
    warnings: list[str]
    crash: str | None = None  # the traceback of an exception that escaped


def run_in_process(args: list[object], monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """`tracesynth ARGS` through the real entry point in this process."""
    from tracesynth.cli import main

    monkeypatch.setattr(sys, "argv", ["tracesynth", *map(str, args)])
    monkeypatch.setenv("TRACESYNTH_SALT", "fuzz")
    err = io.StringIO()
    code, crash = 0, None
    sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own; give pytest its handler back
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        try:
            with _deadline(CASE_TIMEOUT):
                main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - anything else is the traceback a user would see
            crash = traceback.format_exc()
        finally:
            signal.signal(signal.SIGTERM, sigterm)
    return Outcome(code, err.getvalue(), [str(w.message) for w in caught], crash)


def check(case: str, args: list[object], out: Path, mutation: Mutation, outcome: Outcome) -> None:
    where = f"{case} [{mutation.kind}] tracesynth {' '.join(map(str, args))}"
    assert outcome.crash is None, f"{where}: traceback\n{outcome.crash}"
    assert "Traceback" not in outcome.err, f"{where}:\n{outcome.err}"
    assert outcome.code in (0, 1), f"{where}: exit {outcome.code}\n{outcome.err}"
    left = [p.name for p in out.parent.iterdir() if p.name.startswith(".") and p.name.endswith((".tmp", ".old"))]
    assert not left, f"{where}: temporaries left behind: {left}"
    if outcome.code == 1:
        assert not out.exists(), f"{where}: failed but left {out}"
        lines = [ln for ln in outcome.err.splitlines() if ln.strip()]
        assert lines and lines[-1].startswith("error:"), f"{where}: no one-line error\n{outcome.err}"
        return
    assert out.exists(), f"{where}: exit 0 without writing {out}"
    Trace.load(out)  # what it wrote is a valid trace
    if mutation.must_warn:
        said = "\n".join(outcome.warnings) + outcome.err
        assert re.search(mutation.must_warn, said), f"{where}: input skipped without a warning\n{said}"


# -- inputs ----------------------------------------------------------------------------------------
@dataclass
class Format:
    name: str
    source: Path  # pristine input (file or directory)
    command: Callable[[Path, Path], list[object]]  # (input, output) -> CLI args
    mutate: Callable[[Path, random.Random], Mutation]  # damages the copied input in place
    output: str = "o.parquet"


def _ingest(inp: Path, out: Path) -> list[object]:
    return ["ingest", inp, "-o", out]


def _text_mutator(ts_line: str) -> Callable[[Path, random.Random], Mutation]:
    pattern = re.compile(ts_line.encode())

    def mutate(path: Path, rng: random.Random) -> Mutation:
        data, m = mutate_text(path.read_bytes(), rng, pattern)
        path.write_bytes(data)
        return m

    return mutate


def _file_mutator(path: Path, rng: random.Random) -> Mutation:
    kind = rng.choice(list(BYTE_MUTATIONS))
    path.write_bytes(BYTE_MUTATIONS[kind](path.read_bytes(), rng))
    return Mutation(kind)


def _mutate_model(p: Path, rng: random.Random) -> Mutation:
    return mutate_model_json(p, rng) if rng.random() < 0.5 else mutate_dir(p, rng)


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Format]:
    from conftest import LTTNG_WGET, SHARED

    from tracesynth.generators.ar import ARConfig, Autoregressive
    from tracesynth.generators.diffusion import GaussianDiffusion, GaussianDiffusionConfig
    from tracesynth.generators.markov import MarkovChain
    from tracesynth.io.strace import read_strace

    root = tmp_path_factory.mktemp("fuzz-inputs")
    strace = FIXTURES / "strace" / "strace-f-ttt-T.txt"
    trace = read_strace(strace)
    trace.save(root / "t.parquet")
    # small models: the smallest shapes that fit and sample
    cfg = GaussianDiffusionConfig(context=32, d_model=16, n_layers=1, n_heads=2, steps=1, batch_size=2, timesteps=20,
                           sampling_steps=2, checkpoint_every=1, calibrate=False)  # fmt: skip
    GaussianDiffusion(cfg).fit([trace], checkpoint_dir=root / "diffusion")
    MarkovChain(2).fit([trace]).save(root / "markov")
    tiny_ar = dict(context=16, d_model=16, n_layers=1, n_heads=2, steps=1, batch_size=2, chains=2)
    Autoregressive(ARConfig(**tiny_ar)).fit([trace]).save(root / "ar")
    Autoregressive(ARConfig(**tiny_ar, max_tids=3)).fit([trace]).save(root / "ar-other")  # other vocab sizes
    sample = ["--events", "40", "--sampling-steps", "2", "--threads", "1"]
    formats = [
        # strace: "[pid N] SECS.FRAC name(" ; perf script: "comm tid [cpu] SECS.FRAC: event:"
        Format("strace", strace, _ingest, _text_mutator(r"^((?:\[pid +\d+\] +|\d+ +)?)(\d+)(\.\d+ )")),
        Format("perf-script", FIXTURES / "perf" / "perf-script.txt", _ingest, _text_mutator(r"(\] +)(\d+)(\.\d+:)")),
        Format("parquet", root / "t.parquet", lambda i, o: ["anonymize", i, "-o", o], _file_mutator),
        Format("perf-data", FIXTURES / "perf" / "perf.data", _ingest, _file_mutator),
        Format("perf-ctf", FIXTURES / "perf" / "ctf", _ingest, lambda p, r: mutate_dir(p, r, r"perf_stream_\d+")),
        Format("diffusion-model", root / "diffusion", lambda i, o: ["sample", i, "-o", o, *sample], _mutate_model),
        Format("markov-model", root / "markov", lambda i, o: [], _mutate_model),
        Format("ar-model", root / "ar", lambda i, o: ["sample", i, "-o", o, "--events", "40", "--threads", "1"],
               _mutate_model),
    ]
    if LTTNG_WGET.exists():
        formats.append(Format("lttng", LTTNG_WGET, _ingest, lambda p, r: mutate_dir(p, r, r"k_\d+")))
    ctf2 = SHARED / "traces" / "ctf2" / "lttng-crash" / "ctf2"  # read natively: babeltrace2 2.0 cannot
    if ctf2.exists():
        formats.append(Format("lttng-ctf2", ctf2, _ingest, lambda p, r: mutate_dir(p, r, r"chan_\d+")))
    return {f.name: f for f in formats}


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
        for p in [dst, *dst.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    else:
        shutil.copyfile(src, dst)
    return dst


def _markov(inp: Path, out: Path) -> Outcome:
    """The Markov baseline has no CLI: load() and sample() must fail only with TraceSynthError."""
    from tracesynth.generators.markov import MarkovChain

    code, err, crash = 0, "", None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _deadline(CASE_TIMEOUT):
                MarkovChain.load(inp).sample(40, seed=0).save(out)
        except TraceSynthError as exc:
            code, err = 1, f"error: {exc}"
        except BaseException:  # noqa: BLE001
            crash = traceback.format_exc()
    return Outcome(code, err, [str(w.message) for w in caught], crash)


FORMATS = ["lttng", "lttng-ctf2", "perf-ctf", "perf-data", "perf-script", "strace", "parquet", "diffusion-model",
           "markov-model", "ar-model"]
NEEDS = {"lttng": needs_bt2, "perf-ctf": needs_bt2, "perf-data": needs_perf}


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=NEEDS[f]) if f in NEEDS else f for f in FORMATS])
def test_fuzz(fmt: str, inputs: dict[str, Format], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if fmt not in inputs:
        pytest.skip(f"no {fmt} input here (the shared LTTng trace lives beside the repo)")
    f = inputs[fmt]
    # babeltrace2 and perf can loop on damaged input: the readers give up after this long without output
    monkeypatch.setenv("TRACESYNTH_STALL_SECONDS", str(STALL))
    for i in range(CASES):
        rng = random.Random(f"{SEED}:{fmt}:{i}")
        case = tmp_path / f"case{i}"
        case.mkdir()
        inp = _copy(f.source, case / f.source.name)
        mutation = f.mutate(inp, rng)
        out_dir = case / "out"
        out_dir.mkdir()
        out = out_dir / f.output
        args = f.command(inp, out)
        outcome = _markov(inp, out) if fmt == "markov-model" else run_in_process(args, monkeypatch)
        check(f"{fmt} case {i} (seed {SEED})", args, out, mutation, outcome)
        if i == 0 and args:  # once per format, as a user runs it
            sub_out = case / "sub" / f.output
            sub_out.parent.mkdir()
            r = tracesynth(*f.command(inp, sub_out), timeout=CASE_TIMEOUT * 2)
            assert not r.timed_out and "Traceback" not in r.err, r.err
            assert r.code == outcome.code, (r.code, outcome.code, r.err)
        shutil.rmtree(case)


def _without_hashes(model: Path) -> None:
    meta = json.loads((model / "config.json").read_text())
    del meta["sha256"]  # as a model saved before config.json held them: the shapes must still tell
    (model / "config.json").write_text(json.dumps(meta))


def _flip_weight(model: Path) -> None:
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-10] ^= 0x10  # one bit of a weight: the file still parses, only the hash sees it
    (model / "model.safetensors").write_bytes(bytes(data))


# (case, damage to a copied ar model, extra sample args): each must fail in one line naming what is wrong
MUST_FAIL: dict[str, tuple[Callable[[Path, Path], None], list[object], str]] = {
    "flipped-weight": (lambda m, other: _flip_weight(m), [], r"model\.safetensors: sha256 mismatch"),
    "foreign-gaps": (lambda m, other: shutil.copyfile(other / "gaps.safetensors", m / "gaps.safetensors"), [],
                     r"gaps\.safetensors: sha256 mismatch"),
    "foreign-gaps-unhashed": (
        lambda m, other: (shutil.copyfile(other / "gaps.safetensors", m / "gaps.safetensors"), _without_hashes(m)),
        [], r"gaps\.safetensors: tensor seen_\w+ has shape"),
    "foreign-weights-unhashed": (
        lambda m, other: (shutil.copyfile(other / "model.safetensors", m / "model.safetensors"), _without_hashes(m)),
        [], r"model\.safetensors: tensor \S+ has shape"),
    "huge-events": (lambda m, other: None, ["--events", "10000000000"], r"GiB of memory"),
}


@pytest.mark.parametrize("case", list(MUST_FAIL))
def test_damaged_or_foreign_model_files_fail_in_one_line(case: str, inputs: dict[str, Format], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage the safetensors cannot see (a flipped weight, another model's side tensors) and an --events that
    cannot fit must each be refused in one line, not sampled from."""
    damage, extra, message = MUST_FAIL[case]
    model = _copy(inputs["ar-model"].source, tmp_path / "ar")
    damage(model, inputs["ar-model"].source.parent / "ar-other")
    out = tmp_path / "out" / "o.parquet"
    out.parent.mkdir()
    args = ["sample", model, "-o", out, "--threads", "1", *(extra or ["--events", "40"])]
    outcome = run_in_process(args, monkeypatch)
    check(case, args, out, Mutation(case), outcome)
    lines = [ln for ln in outcome.err.splitlines() if ln.strip()]
    assert outcome.code == 1 and len(lines) == 1 and re.search(message, lines[0]), outcome.err
