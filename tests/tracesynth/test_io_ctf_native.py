"""The native CTF reader (tracesynth.io.ctf) against the babeltrace2 text path and across CTF versions,
its compiled core against its Python decoder, and CTF 2 written by `tracesynth export --ctf-version 2`
(which Debian's babeltrace2 2.0.4 cannot read: it refuses every CTF 2 trace).

The shared traces live beside the repository (../shared/traces): those tests skip where it is absent.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tracesynth.errors import TraceSynthError
from tracesynth.io import read_trace
from tracesynth.io.babeltrace import Field, ctf_decoder, iter_ctf_batches
from tracesynth.io.ctf import Want, decode_trace, iter_native_batches, load_metadata
from tracesynth.trace import Trace

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "traces"
WGET = SHARED / "lttng-wget-kernel"
CTF2 = SHARED / "ctf2"
PERF_CTF = REPO / "tests" / "fixtures" / "perf" / "ctf"
needs_bt2 = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces lives beside the repo (absent here)")
# the twins babeltrace2 2.0.4 prints with timestamps (the others have no clock)
TWINS = [
    "barectf-event-before-packet",
    "debug-info",
    "ev-disc-no-ts-begin-end",
    "lttng-crash",
    "lttng-event-after-packet",
    "meta-variant-no-underscore",
    "smalltrace",
    "succeed1",
]
CLOCKED = {"barectf-event-before-packet", "debug-info", "lttng-crash", "lttng-event-after-packet"}
# the authors' twins differ in one byte of data: debug-info's library path
KNOWN_DATA_DIFFS = {"debug-info": {("path", "str"): [b"/libhello-so", b"/libhello_so"]}}


def _read(path: Path, decoder: str):
    token = ctf_decoder.set(decoder)
    try:
        return read_trace(path)
    finally:
        ctf_decoder.reset(token)


@needs_bt2
@pytest.mark.parametrize(
    "trace", [pytest.param(WGET, marks=needs_shared, id="lttng-wget"), pytest.param(PERF_CTF, id="perf-ctf")]
)
def test_native_reader_equals_babeltrace2(trace: Path) -> None:
    ref = _read(trace, "babeltrace2")
    got = _read(trace, "native")
    assert got.table.equals(ref.table)  # every column, dictionaries included
    assert got.metadata == ref.metadata


def _all_fields(path: Path) -> list[Want]:
    tc = load_metadata(path)
    strip = tc.version != "2"
    names = set()
    for sc in tc.streams.values():
        for ev in sc.events.values():
            for fc in (sc.event_context, ev.context, ev.payload):
                names |= {n[1:] if strip and n.startswith("_") else n for n, _ in (fc.fields if fc else [])}
    return [Want(n, k, "any") for n in sorted(names) for k in ("int", "str")]


@needs_shared
@pytest.mark.parametrize("name", TWINS)
def test_ctf2_decodes_like_its_ctf18_twin(name: str) -> None:
    a, b = CTF2 / name / "ctf1.8", CTF2 / name / "ctf2"
    wants = _all_fields(a)
    assert [(w.name, w.kind) for w in wants] == [(w.name, w.kind) for w in _all_fields(b)]
    x, y = decode_trace(a, wants), decode_trace(b, wants)
    assert (x["ts"] is None) == (y["ts"] is None) == (name not in CLOCKED)
    if x["ts"] is not None:
        assert x["ts"].tolist() == y["ts"].tolist()
    assert [x["names"][i] for i in x["event"]] == [y["names"][i] for i in y["event"]]
    assert len(x["event"]) > 0
    assert x["cpu"][0][x["cpu"][1]].tolist() == y["cpu"][0][y["cpu"][1]].tolist()
    for w, (xv, xok), (yv, yok) in zip(wants, x["columns"], y["columns"], strict=True):
        assert xok.tolist() == yok.tolist(), w
        known = KNOWN_DATA_DIFFS.get(name, {}).get((w.name, w.kind))
        xs, ys = xv[xok].tolist(), yv[yok].tolist()
        if known:
            xs = [known[1] if v == known[0] else v for v in xs]
        assert xs == ys, w


@needs_bt2
@needs_shared
@pytest.mark.parametrize("name", sorted(CLOCKED))
def test_ctf18_twin_equals_babeltrace2(name: str) -> None:
    path = CTF2 / name / "ctf1.8"
    fields = [Field(w.name, w.kind) for w in _all_fields(path)]
    token = ctf_decoder.set("babeltrace2")
    try:
        ref = pa.Table.from_batches(list(iter_ctf_batches(path, fields)))
    finally:
        ctf_decoder.reset(token)
    got = pa.Table.from_batches(list(iter_native_batches(path, fields)))
    assert got.to_pylist() == ref.to_pylist()


@needs_shared
def test_ctf2_lttng_trace_ingests() -> None:
    t = read_trace(CTF2 / "lttng-crash" / "ctf2")
    assert len(t) == 400 and t.metadata["source_format"] == "lttng"
    assert t.table.equals(read_trace(CTF2 / "lttng-crash" / "ctf1.8").table)


@needs_shared
def test_a_trace_without_a_clock_is_one_error() -> None:
    with pytest.raises(TraceSynthError, match="no clock"):
        list(iter_native_batches(CTF2 / "smalltrace" / "ctf2", []))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


@pytest.mark.parametrize("cut", [60, 1000, 5000])
def test_truncated_stream_is_one_error_naming_the_file(tmp_path: Path, cut: int) -> None:
    t = _copy(PERF_CTF, tmp_path / "t")
    stream = t / "perf_stream_0"
    stream.write_bytes(stream.read_bytes()[:cut])
    with pytest.raises(TraceSynthError, match="cannot read this trace") as exc:
        list(iter_native_batches(t, []))
    assert "perf_stream_0" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("damage", [b"trace { major = ; };", b"/* CTF 1.8 */ struct { integer { size = 99; } x; };"])
def test_bad_tsdl_is_one_error_naming_metadata(tmp_path: Path, damage: bytes) -> None:
    t = _copy(PERF_CTF, tmp_path / "t")
    (t / "metadata").write_bytes(damage)
    with pytest.raises(TraceSynthError, match="bad CTF metadata") as exc:
        list(iter_native_batches(t, []))
    assert "metadata" in str(exc.value)


@needs_shared
@pytest.mark.parametrize(
    "damage", [b"\x1e{", b'\x1e{"type": "preamble", "version": 2}\x1e{"type": "data-stream-class", "id": "x"}']
)
def test_bad_ctf2_metadata_is_one_error(tmp_path: Path, damage: bytes) -> None:
    t = _copy(CTF2 / "lttng-crash" / "ctf2", tmp_path / "t")
    (t / "metadata").write_bytes(damage)
    with pytest.raises(TraceSynthError, match="bad CTF metadata"):
        list(iter_native_batches(t, []))


def test_unknown_decoder_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACESYNTH_CTF_DECODER", "bogus")
    with pytest.raises(TraceSynthError, match="unknown CTF decoder"):
        read_trace(PERF_CTF)


# --- the compiled cores (tracesynth.io.ctf.fast: Cython, numba) against the Python decoder ------
SMALL = [pytest.param(PERF_CTF, id="perf-ctf")] + [
    pytest.param(CTF2 / n / v, marks=needs_shared, id=f"{n}-{v}") for n in TWINS for v in ("ctf1.8", "ctf2")
]


def _cython_built() -> bool:
    from tracesynth.io.ctf import fast

    return fast._cython() is not None


needs_cython = pytest.mark.skipif(
    not _cython_built(), reason="the Cython core is not built (no C compiler or Cython at install time)"
)
CORES = [pytest.param("cython", marks=needs_cython), "numba"]


@pytest.fixture(params=CORES)
def core(request: pytest.FixtureRequest) -> str:
    """Each compiled core in turn (numba's skipped where numba is not installed)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    return request.param


def _use(monkeypatch: pytest.MonkeyPatch, core: str, chunk: int = 1 << 16) -> None:
    """Decode with `core` ("python": the generated Python decoder) on any trace, in chunks of `chunk`."""
    from tracesynth.io.ctf import stream

    monkeypatch.setenv("TRACESYNTH_CTF_CORE", core)
    monkeypatch.setattr(stream, "FAST_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "AOT_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "CHUNK", chunk)


def _decode(monkeypatch: pytest.MonkeyPatch, path: Path, wants: list[Want], core: str, chunk: int = 1 << 16):
    _use(monkeypatch, core, chunk)
    return decode_trace(path, wants)


def _assert_same(x: dict, y: dict) -> None:
    assert (x["ts"] is None) == (y["ts"] is None)
    if x["ts"] is not None:
        assert x["ts"].tolist() == y["ts"].tolist()
    assert [x["names"][i] for i in x["event"]] == [y["names"][i] for i in y["event"]]
    for (xv, xok), (yv, yok) in zip([x["cpu"], *x["columns"]], [y["cpu"], *y["columns"]], strict=True):
        assert xok.tolist() == yok.tolist()
        assert xv[xok].tolist() == yv[yok].tolist()


@needs_cython
def test_the_cython_core_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracesynth.io.ctf import fast, stream

    monkeypatch.delenv("TRACESYNTH_CTF_CORE", raising=False)
    assert fast.kernels().name == "cython" and fast.cheap() and stream.AOT_MIN_BYTES == 0
    monkeypatch.setenv("TRACESYNTH_CTF_CORE", "python")
    assert fast.kernels() is None and fast.loaded() is None and not fast.cheap()


@needs_cython
def test_a_read_with_the_cython_core_never_imports_numba() -> None:
    """The point of the ahead-of-time core: no numba import (half a second, 150 MB) in a reading process."""
    code = (
        "import sys; from tracesynth.io import read_trace; from tracesynth.io.ctf import fast; "
        f"read_trace({str(PERF_CTF)!r}); print(fast.loaded().name, 'numba' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRACESYNTH_CTF_CORE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cython", "False"]


def test_metadata_is_parsed_once_per_content(tmp_path: Path) -> None:
    t = _copy(PERF_CTF, tmp_path / "t")
    a = load_metadata(t)
    assert load_metadata(t) is a and load_metadata(PERF_CTF) is a  # the same bytes: the same parse
    meta = t / "metadata"
    meta.write_bytes(meta.read_bytes() + b"\n/* changed */\n")
    b = load_metadata(t)
    assert b is not a and b.streams.keys() == a.streams.keys()
    meta.write_bytes(b"\x00garbage")
    with pytest.raises(TraceSynthError, match="metadata"):
        load_metadata(t)


def test_unknown_core_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACESYNTH_CTF_CORE", "rust")
    with pytest.raises(TraceSynthError, match="unknown CTF core 'rust'"):
        read_trace(PERF_CTF)


@pytest.mark.parametrize("trace", SMALL)
def test_compiled_core_equals_python_decoder(monkeypatch: pytest.MonkeyPatch, trace: Path, core: str) -> None:
    """Every field of every event, with chunks of 7 events (a packet split across chunks, streams
    muxed chunk by chunk) and of the default size."""
    wants = _all_fields(trace)
    ref = _decode(monkeypatch, trace, wants, "python")
    for chunk in (7, 1 << 16):
        _assert_same(_decode(monkeypatch, trace, wants, core, chunk=chunk), ref)


@needs_shared
def test_compiled_core_reads_the_wget_trace_like_python(monkeypatch: pytest.MonkeyPatch, core: str) -> None:
    """The compact/extended LTTng event header (a variant), sequences of structs, read_lttng's fields."""
    _use(monkeypatch, "python")
    ref = read_trace(WGET)
    _use(monkeypatch, core, chunk=1000)
    got = read_trace(WGET)
    assert got.table.equals(ref.table)


@pytest.mark.parametrize("cut", [60, 1000, 5000])
def test_damage_found_by_the_core_is_reported_as_python_reports_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cut: int, core: str
) -> None:
    t = _copy(PERF_CTF, tmp_path / "t")
    s = t / "perf_stream_0"
    s.write_bytes(s.read_bytes()[:cut])
    msgs = []
    for which, chunk in (("python", 1 << 16), (core, 1 << 16), (core, 7)):  # 7: the core stops after yielding rows
        _use(monkeypatch, which, chunk)
        with pytest.raises(TraceSynthError) as exc:
            list(iter_native_batches(t, []))
        msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] == msgs[2]


def _outcome(t: Path) -> object:
    """The error, or the events (sorted: garbage timestamps make a stream go back in time, and
    such a stream muxes chunk by chunk)."""
    try:
        rows = pa.Table.from_batches(list(iter_native_batches(t, [Field("pid"), Field("tid")]))).to_pylist()
    except TraceSynthError as exc:
        return str(exc)
    return sorted(rows, key=repr)


def _garbage(src: Path, dest: Path, at: int) -> Path:
    t = _copy(src, dest)
    s = t / "perf_stream_0"
    data = bytearray(s.read_bytes())
    data[at : at + 8] = b"\xff" * 8
    s.write_bytes(bytes(data))
    return t


@pytest.mark.parametrize("at", [300, 700, 1500, 3000])
def test_garbage_inside_a_packet_reads_as_python_reads_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, at: int, core: str
) -> None:
    """Where the core meets what it cannot decode, the Python decoder redoes the packet: the same
    error, or the same events."""
    t = _garbage(PERF_CTF, tmp_path / "t", at)
    got = []
    for which, chunk in (("python", 1 << 16), (core, 1 << 16), (core, 7)):
        _use(monkeypatch, which, chunk)
        got.append(_outcome(t))
    assert got[0] == got[1] == got[2]


def _numbers_one_per_kind(data: bytes) -> list[tuple[int, int]]:
    """The spans of the numbers in `data`, one per kind: the first of those with the same digits after
    the same 16 bytes (their digits blanked), so one `size = 32` of an integer, one `align = 1`, one
    `} align(8)` after each struct's last field name, each event's id, each digit group of a uuid."""
    kinds: dict[tuple[bytes, bytes], tuple[int, int]] = {}
    for m in re.finditer(rb"\d+", data):
        before = re.sub(rb"\d+", b"0", data[max(0, m.start() - 16) : m.start()])
        kinds.setdefault((before, m.group()), m.span())
    return list(kinds.values())


@pytest.fixture(scope="module")
def python_outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One copy of the perf trace, and the Python decoder's outcome on it by (replacement, span): the
    same for each core, so computed once."""
    return _copy(PERF_CTF, tmp_path_factory.mktemp("int64") / "t"), {}


@pytest.mark.parametrize("big", [b"18446744073709551616", b"9223372036854775808"])
def test_numbers_past_int64_in_the_metadata_read_as_python_reads_them(
    monkeypatch: pytest.MonkeyPatch, python_outcomes: tuple[Path, dict], big: bytes, core: str
) -> None:
    """Each kind of number of the metadata in turn made too big for the core's instructions: the
    stream class goes to the Python decoder (the same error, or the same events), never a crash."""
    t, ref = python_outcomes
    meta = t / "metadata"
    data = (PERF_CTF / "metadata").read_bytes()
    kinds = []
    for a, b in _numbers_one_per_kind(data):
        meta.write_bytes(data[:a] + big + data[b:])
        if (big, a) not in ref:
            _use(monkeypatch, "python")
            ref[big, a] = _outcome(t)
        _use(monkeypatch, core)
        assert _outcome(t) == ref[big, a], (a, data[a:b])
        kinds.append(type(ref[big, a]))
    assert str in kinds and list in kinds  # some errors, some events read in spite of the number


def test_core_stopping_mid_packet_hands_over_to_python(monkeypatch: pytest.MonkeyPatch, core: str) -> None:
    """The core gives up on a packet after some of its rows went out in a chunk: the Python
    decoder redoes the packet, those rows skipped, and reads on."""
    from tracesynth.io.ctf import fast

    wants = _all_fields(PERF_CTF)
    ref = _decode(monkeypatch, PERF_CTF, wants, "python")
    real, calls = fast.run_packet, []

    def flaky(prog, buf, base, lim, p, end, clk, n, out):  # noqa: ANN001, ANN202
        calls.append(n)
        if len(calls) == 3:
            return fast.BAD, p, clk, n
        return real(prog, buf, base, lim, p, end, clk, n, out)

    monkeypatch.setattr(fast, "run_packet", flaky)
    _assert_same(_decode(monkeypatch, PERF_CTF, wants, core, chunk=50), ref)
    assert calls[2] == 0 and len(calls) > 3  # it stopped at a chunk start, inside a packet


# --- the two compiled cores against each other, call by call ------------------------------------
def _recorded(monkeypatch: pytest.MonkeyPatch, core: str, path: Path, wants: list[Want], chunk: int) -> tuple:
    """(what each run_packet call returned, with the rows it wrote; the decode's result or its error)."""
    from tracesynth.io.ctf import fast

    real, calls = fast.run_packet, []

    def record(prog, buf, base, lim, p, end, clk, n, out):  # noqa: ANN001, ANN202
        status, p2, clk2, n2 = real(prog, buf, base, lim, p, end, clk, n, out)
        valid = out.valid[:, n:n2].astype(bool)
        rows = [out.ts[n:n2], out.ids[n:n2], valid, np.where(valid, out.vals[:, n:n2], 0)]
        strs = np.where(valid, out.lens[:, n:n2], 0)[[j for j, w in enumerate(wants) if w.kind != "int"]]
        calls.append((int(status), int(p2), int(clk2), int(n2), [r.copy() for r in (*rows, strs)]))
        return status, p2, clk2, n2

    _use(monkeypatch, core, chunk)
    monkeypatch.setattr(fast, "run_packet", record)
    try:
        got: object = decode_trace(path, wants)
    except TraceSynthError as exc:
        got = str(exc)
    monkeypatch.setattr(fast, "run_packet", real)
    assert fast.loaded().name == core
    return calls, got


def _cores_agree(monkeypatch: pytest.MonkeyPatch, path: Path, chunk: int = 1 << 16) -> list:
    pytest.importorskip("numba")
    wants = _all_fields(path)
    cy_calls, cy = _recorded(monkeypatch, "cython", path, wants, chunk)
    nb_calls, nb = _recorded(monkeypatch, "numba", path, wants, chunk)
    assert cy_calls and len(cy_calls) == len(nb_calls)
    for x, y in zip(cy_calls, nb_calls, strict=True):  # every status, position, clock and row, call by call
        assert x[:4] == y[:4]
        assert all(np.array_equal(a, b) for a, b in zip(x[4], y[4], strict=True))
    assert isinstance(cy, str) == isinstance(nb, str)
    if isinstance(cy, str):
        assert cy == nb
    else:
        _assert_same(cy, nb)
    return cy_calls


@needs_cython
@pytest.mark.parametrize(
    ("trace", "chunk"),
    [pytest.param(t.values[0], c, marks=t.marks, id=f"{t.id}-{c}") for t in SMALL for c in (7, 1 << 16)]
    + [pytest.param(WGET, 1000, marks=needs_shared, id="lttng-wget-1000")],
)
def test_cython_and_numba_cores_agree(monkeypatch: pytest.MonkeyPatch, trace: Path, chunk: int) -> None:
    """Every field of every event, chunks splitting packets (7, 1000) or not."""
    _cores_agree(monkeypatch, trace, chunk)


@needs_cython
@pytest.mark.parametrize("at", [64, 304, 1504, 3024])  # garbage there makes the core stop (BAD)
def test_cython_and_numba_cores_agree_on_damage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, at: int) -> None:
    """The same status, position and rows where the bytes go bad (so the same packet goes back to
    Python), and the same error from it."""
    from tracesynth.io.ctf import fast

    calls = _cores_agree(monkeypatch, _garbage(PERF_CTF, tmp_path / "t", at))
    assert calls[-1][0] == fast.BAD


def test_event_name_patterns_match_as_fnmatchcase() -> None:
    """Literal names by a set lookup, wildcards by fnmatch's regex: the same answers as fnmatchcase."""
    import fnmatch

    from tracesynth.io.ctf.decode import _patterns

    names = ["sched_switch", "syscall_exit_read", "compat_syscall_exit_x", "a[b]", "ab", "a?", "", "sched_switc"]
    for pats in ([], ["sched_switch"], ["syscall_exit_*", "sched_switch"], ["a[[]b]", "a?"], ["*"], ["a[b]"]):
        match = _patterns(pats)
        assert [bool(match(n)) for n in names] == [any(fnmatch.fnmatchcase(n, p) for p in pats) for n in names]


def test_carry_derives_threads_as_the_numpy_forward_fill(monkeypatch: pytest.MonkeyPatch, core: str) -> None:
    """read_lttng's per-CPU thread state through the core's `carry`, block by block, against the
    vectorised numpy fill it replaces: the same tid/comm of every row and the same state carried
    (unknown CPUs, switches to unknown tasks, CPUs first switching in a later block)."""
    from tracesynth.io.ctf import fast
    from tracesynth.io.lttng import _SchedState

    monkeypatch.setenv("TRACESYNTH_CTF_CORE", core)
    monkeypatch.setattr(fast, "_KERNELS", {})
    k = fast.kernels()
    assert k is not None and k.name == core
    rng = np.random.default_rng(7)
    via_core, via_numpy = _SchedState(), _SchedState()
    for block in range(6):
        n = int(rng.integers(0, 400))
        cpu = rng.integers(-1, 4 + block, n)
        sw = rng.random(n) < 0.2
        m = int(sw.sum())  # the switches' (tid, comm), in row order
        prev = (rng.integers(-1, 50, m), rng.integers(-1, 9, m).astype(np.int32))
        nxt = (rng.integers(-1, 50, m), rng.integers(-1, 9, m).astype(np.int32))
        got = via_core.derive(cpu, sw, prev, nxt)
        want = via_numpy._derive_numpy(cpu, sw, prev, nxt)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
        assert (via_core.tid, via_core.comm) == (via_numpy.tid, via_numpy.comm)


# --- CTF 2 written by `tracesynth export --ctf-version 2` ---------------------------------------
def _sample(n: int = 3000) -> Trace:
    """Nulls in every nullable column, several CPUs and one null CPU, sched_switch rows, odd comms."""
    import numpy as np

    rng = np.random.default_rng(7)
    ts = 1_700_000_000_000_000_000 + np.cumsum(rng.integers(1, 5000, n))
    names = np.array(["sched_switch", "syscall_entry_read", "syscall_exit_read", "irq_handler_entry"])
    event = rng.choice(names, n)
    cpu = rng.integers(0, 3, n).astype(object)
    cpu[rng.random(n) < 0.05] = None
    tid = rng.integers(0, 5000, n).astype(object)
    tid[rng.random(n) < 0.1] = None
    comm = rng.choice(np.array(["wget", "swapper/0", "ünïcødé", 'q"uote', "kworker/u8:2"], dtype=object), n)
    comm[rng.random(n) < 0.1] = None
    ret = rng.integers(-4096, 1 << 40, n).astype(object)
    ret[event != "syscall_exit_read"] = None
    return Trace.from_columns(ts, event, cpu, tid, comm, ret, metadata={"source_format": "synthetic", "seed": 7})


@pytest.mark.parametrize("context", [True, False])
def test_ctf2_export_reads_back_to_the_same_trace(tmp_path: Path, context: bool) -> None:
    """A trace written as CTF 2 (JSON metadata, the CTF 1.8 export's packets) reads back through
    the native reader to the same Trace as its CTF 1.8 twin. No babeltrace2 reads it here: Debian
    12's babeltrace2 2.0.4 refuses every CTF 2 trace (2.1 or later reads CTF 2)."""
    from tracesynth.io.ctf_writer import write_ctf
    from tracesynth.io.lttng import read_lttng

    trace = _sample()
    write_ctf(trace, tmp_path / "v2", ctf_version="2", context=context, packet_bytes=4096)
    write_ctf(trace, tmp_path / "v18", context=context, packet_bytes=4096)
    assert (tmp_path / "v2" / "metadata").read_bytes().startswith(b"\x1e{")
    assert (tmp_path / "v18" / "metadata").read_text().startswith("/* CTF 1.8 */")
    assert load_metadata(tmp_path / "v2").version == "2"
    for f in (tmp_path / "v18").glob("channel0_*"):  # the same layout, byte counts included
        assert (tmp_path / "v2" / f.name).stat().st_size == f.stat().st_size
    back = read_lttng(tmp_path / "v2")
    assert back.table.equals(read_lttng(tmp_path / "v18").table)
    if context:
        assert back == trace and back.metadata == trace.metadata


def test_cli_exports_ctf2(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from tracesynth.cli import main

    def cli(*args: object) -> int:
        monkeypatch.setattr(sys, "argv", ["tracesynth", *map(str, args)])
        try:
            main()
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    trace = _sample(200)
    trace.save(tmp_path / "t.parquet")
    assert cli("export", tmp_path / "t.parquet", "--to", "ctf", "--ctf-version", "2", tmp_path / "ctf") == 0
    assert load_metadata(tmp_path / "ctf").version == "2"
    assert _read(tmp_path / "ctf", "native") == trace
    assert cli("export", tmp_path / "t.parquet", "--to", "ctf", "--ctf-version", "3", tmp_path / "bad") == 1
    assert "unknown CTF version '3'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_core_that_cannot_compile_falls_back_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cores that cannot load (a numba of another version, a broken LLVM, a broken build) cost
    speed, not the read."""
    from tracesynth.io.ctf import fast

    def broken(k: object) -> None:
        raise RuntimeError("no LLVM today")

    wants = _all_fields(PERF_CTF)
    ref = _decode(monkeypatch, PERF_CTF, wants, "python")
    _use(monkeypatch, "auto")
    monkeypatch.setattr(fast, "_KERNELS", {})
    monkeypatch.setattr(fast, "_warm_up", broken)
    if fast._cython() is None and importlib.util.find_spec("numba") is None:
        pytest.skip("no compiled core is installed")
    with pytest.warns(UserWarning, match="compiled CTF core is unavailable"):
        got = decode_trace(PERF_CTF, wants)
    _assert_same(got, ref)
    assert fast.loaded() is None


def test_a_core_asked_for_and_missing_warns_and_reads_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracesynth.io.ctf import fast

    wants = _all_fields(PERF_CTF)
    ref = _decode(monkeypatch, PERF_CTF, wants, "python")
    _use(monkeypatch, "cython")
    monkeypatch.setattr(fast, "_KERNELS", {})
    monkeypatch.setattr(fast, "_cython", lambda: None)  # as without a C compiler at install time
    with pytest.warns(UserWarning, match=r"unavailable \(cython: not installed\)"):
        got = decode_trace(PERF_CTF, wants)
    _assert_same(got, ref)
