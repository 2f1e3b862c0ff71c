"""A compiled core for the per-event loop: field classes compiled to a small instruction program
that one compiled interpreter runs over a packet's events, writing numpy columns.

Per stream class, `compile_program` turns the event header, the common context and each event
class's context and payload into instructions (align, skip, read an integer into a register,
strings and byte arrays as offsets, variant branches, array loops, clock update, outputs to
columns). It raises FastUnsupported for what it cannot express (references into the packet
scopes, integers over 64 bits, selector ranges outside int64); such stream classes keep the
generated Python decoder (tracesynth.io.ctf.decode). At run time any status but OK or FULL
makes the caller decode the rest of the stream file with that Python decoder, which then
reports the damage exactly as it always has.

The interpreter (`_run`, with `_data`, `_read_int`, `_leb`, and `intern`, `first_seen`, `carry`) exists
twice, with the same signatures and results: ahead of time in Cython (tracesynth.io.ctf._core,
built with the package where a C compiler is; loads in about a millisecond) and in this file for
numba (imported and its cache loaded on first use: about half a second and 150 MB of a process's
memory; it compiles the interpreter once per machine, about 10 s, cached next to this file, or
in NUMBA_CACHE_DIR where that is not writable). `kernels` takes the first of them that loads;
without either every stream uses the Python path (a warning).

TRACESYNTH_CTF_CORE picks one: `cython`, `numba` or `python` (no compiled core); unset or `auto`,
the first that loads. A core that is asked for and does not load means the Python decoder (a
warning), never the other core.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from tracesynth.errors import TraceSynthError
from tracesynth.io.ctf.compile import _label_ranges, align_of, lookup_ref, ref_names, static_size
from tracesynth.io.ctf.model import Array, Blob, Float, Int, Optional, Ref, String, Struct, Variant

# opcodes (instruction: op, a, b, c, d)
END, ALIGN, SKIP, INT, LEB, CSTR, BYTES, SKIPN, JIN, JMP, FAIL, CLOCK, SETID, OUT, OUTS, LOOP, NEXT = range(17)
# kernel statuses: the packet is done, the output is full, or anything else (the Python decoder redoes it)
OK, FULL, BAD = 0, 1, 2
_I64 = (-(1 << 63), (1 << 63) - 1)
_MAX_IDS = 1 << 20


class FastUnsupported(ValueError):
    """A layout the instruction set does not express (the Python decoder handles it)."""


@dataclass
class Program:
    """The instructions of one stream class and where each event class's part starts."""

    code: np.ndarray  # int64 (n, 5)
    evstart: np.ndarray  # int64, -1 for ids not in the metadata
    default_id: int  # the id when the header has none: the only event class's, else 0
    nregs: int
    ncols: int


class _Compiler:
    def __init__(self, refs: set[str]) -> None:
        self.refs = refs
        self.code: list[list[int]] = []
        self.nregs = 0
        self.scopes: list[dict[tuple[str, ...], int]] = []
        self.roots: dict[str, dict[tuple[str, ...], int]] = {}
        self.fcs: dict[int, Any] = {}  # register -> its integer class (variant selectors)
        self.mode = "event"
        # what is known of p here: p % known == res; alignments it satisfies become skips, and
        # skips in a row one (never across `barrier`, the latest jump target)
        self.known, self.res, self.barrier = 1, 0, 0

    def op(self, *args: int) -> int:
        ins = [*args, *[0] * (5 - len(args))]
        kind, a = ins[0], ins[1]
        if kind == ALIGN:
            if a <= 1:
                return len(self.code) - 1
            if self.known >= a:
                return self.op(SKIP, -self.res % a)
            self.known, self.res = a, 0
        elif kind == SKIP:
            self.res = (self.res + a) % self.known
            last = self.code[-1] if len(self.code) > self.barrier else None
            if last is not None and last[0] == SKIP:
                last[1] += a
                return len(self.code) - 1
            if not a:
                return len(self.code) - 1
        self._track(ins)
        self.code.append(ins)
        return len(self.code) - 1

    def _track(self, ins: list[int]) -> None:
        """The alignment known after a data instruction other than ALIGN and SKIP."""
        kind, a, b, c = ins[:4]
        if kind == INT:
            self.res = (self.res + a) % self.known
        elif kind in (LEB, CSTR) or (kind == BYTES and (a >= 0 or self.known < 8)):
            self.known, self.res = 8, 0  # these end on a byte
        elif kind == BYTES:
            self.res = (self.res + 8 * b) % self.known
        elif kind == SKIPN and a < 0:
            self.res = (self.res + b * c) % self.known
        elif kind == SKIPN:
            self.known = min(self.known, b & -b if b else 1 << 30)
            self.res %= self.known

    def label(self, known: int = 1, res: int = 0) -> int:
        """A jump target here, reached with p % known == res."""
        self.barrier = len(self.code)
        self.known, self.res = known, res % known
        return len(self.code)

    def reg(self, n: int = 1) -> int:
        self.nregs += n
        return self.nregs - n

    def lookup(self, ref: Ref) -> int:
        return lookup_ref(ref, self.roots, self.scopes, FastUnsupported)

    def root(self, fc: Struct | None, root: str, want: dict[str, list[tuple[str, int]]]) -> None:
        """One root scope; `want`: member -> [(kind, column)] to write."""
        table: dict[tuple[str, ...], int] = {}
        self.roots[root] = table
        if fc is None:
            return
        self.op(ALIGN, max(fc.align, 1))
        self.scopes.append(table)
        for n, f in fc.fields:
            r = self.field(f, n, keep=n in want)
            for kind, col in want.get(n, ()):
                if r is not None and col >= 0:
                    self.op(OUT if kind == "int" else OUTS, r, col)
        self.scopes.pop()

    def field(self, fc: Any, name: str | None, keep: bool = False) -> int | None:
        keep = keep or (name is not None and name in self.refs)
        if isinstance(fc, Int):
            return self.integer(fc, name, keep)
        if isinstance(fc, Float):
            self.op(ALIGN, fc.align)
            self.op(SKIP, fc.size)
            return None
        if isinstance(fc, String):
            return self.string(fc, keep)
        if isinstance(fc, Blob):
            self.op(ALIGN, max(fc.align, 8))
            self.bytes_(fc.length, keep=False, text=False)
            return None
        if isinstance(fc, Struct):
            self.op(ALIGN, align_of(fc))
            self.scopes.append({})
            for n, f in fc.fields:
                self.field(f, n)
            self._expose(name, self.scopes.pop())
            return None
        if isinstance(fc, Array):
            return self.array(fc, keep)
        if isinstance(fc, Variant | Optional):
            self.choice(fc, name)
            return None
        raise FastUnsupported(f"unknown field class {type(fc).__name__}")

    def _expose(self, name: str | None, inner: dict[tuple[str, ...], int]) -> None:
        if name is not None and self.scopes:
            for k, v in inner.items():
                self.scopes[-1][(name, *k)] = v

    def integer(self, fc: Int, name: str | None, keep: bool) -> int | None:
        hook = self.mode == "header" and (fc.role == "id" or fc.clock is not None)
        if fc.varlen:
            self.op(ALIGN, 8)
        else:
            if fc.size > 64 or fc.size < 1:
                raise FastUnsupported("an integer wider than 64 bits")
            self.op(ALIGN, fc.align)
        if not (keep or hook):
            if fc.varlen:
                self.op(LEB, 0, int(fc.signed), -1)
            else:
                self.op(SKIP, fc.size)
            return None
        r = self.reg()
        if fc.varlen:
            self.op(LEB, 0, int(fc.signed), r)
        else:
            self.op(INT, fc.size, int(fc.signed) | 2 * int(fc.little), r)
        if name is not None and self.scopes:
            self.scopes[-1][(name,)] = r
        self.fcs[r] = fc
        if hook and fc.role == "id":
            self.op(SETID, r)
        if hook and fc.clock is not None:
            self.op(CLOCK, r, fc.size, int(fc.size >= 64))  # a 64-bit (or LEB128) clock: the value itself
        return r

    def string(self, fc: String, keep: bool) -> int | None:
        self.op(ALIGN, 8)
        if fc.length is None:
            r = self.reg(2) if keep else -1
            self.op(CSTR, 0, 0, r)
            return r if keep else None
        return self.bytes_(fc.length, keep, text=True)

    def bytes_(self, length: int | Ref, keep: bool, text: bool) -> int | None:
        r = self.reg(2) if keep else -1
        if isinstance(length, int):
            self.op(BYTES, -1, length, r, int(text))
        else:
            self.op(BYTES, self.lookup(length), 0, r, int(text))
        return r if keep else None

    def array(self, fc: Array, keep: bool) -> int | None:
        self.op(ALIGN, max(fc.align, align_of(fc.element)))
        el = fc.element
        if isinstance(el, Int) and el.size == 8 and el.encoding:  # text: babeltrace2 shows a string
            return self.bytes_(fc.length, keep, text=True)
        s = static_size(el)
        n = -1 if isinstance(fc.length, int) else self.lookup(fc.length)
        if s is not None and s[0] % s[1] == 0 and not self._has_refs(el):
            self.op(SKIPN, n, s[0], fc.length if isinstance(fc.length, int) else 0)
            return None
        counter = self.reg()
        head = self.op(LOOP, n, fc.length if isinstance(fc.length, int) else 0, counter, 0)
        body = self.label()  # each element starts wherever the one before ended
        self.scopes.append({})
        self.field(el, None)
        self.scopes.pop()
        self.op(NEXT, counter, 0, 0, body)
        self.code[head][4] = self.label()
        return None

    def _has_refs(self, fc: Any) -> bool:
        if isinstance(fc, Struct):
            return any(n in self.refs or self._has_refs(f) for n, f in fc.fields)
        return isinstance(fc, Array) and self._has_refs(fc.element)

    def choice(self, fc: Variant | Optional, name: str | None) -> None:
        sel = self.lookup(fc.selector)
        if isinstance(fc, Optional):
            branches = [(fc.ranges, fc.element, None)]
        else:
            branches = [(r if r is not None else _label_ranges(self.fcs.get(sel), n), f, n) for n, f, r in fc.options]
        tests = []
        for k, (ranges, _, _) in enumerate(branches):
            if ranges is None:  # a boolean selector: any value but 0
                tests.append(self.op(JIN, sel, 0, 0, -2))  # 0: skip the element
                tests.append(self.op(JMP, 0, 0, 0, -(k + 10)))
                continue
            for lo, hi in ranges:
                if not (_I64[0] <= lo <= _I64[1] and _I64[0] <= hi <= _I64[1]):
                    raise FastUnsupported("a selector range outside int64")
                tests.append(self.op(JIN, sel, lo, hi, -(k + 10)))
        tests.append(self.op(FAIL, 0) if isinstance(fc, Variant) else self.op(JMP, 0, 0, 0, -2))
        k0, r0 = self.known, self.res
        starts, ends, states = [], [], [] if isinstance(fc, Variant) else [(k0, r0)]
        for _, f, oname in branches:
            starts.append(self.label(k0, r0))
            self.scopes.append({})
            self.field(f, oname)
            inner = self.scopes.pop()
            self._expose(name, inner)
            states.append((self.known, self.res))
            ends.append(self.op(JMP, 0, 0, 0, -2))
        a = min(k for k, _ in states)
        while a > 1 and len({r % a for _, r in states}) > 1:
            a //= 2
        done = self.label(a, states[0][1])
        for i in [*tests, *ends]:
            t = self.code[i][4]
            if t == -2:
                self.code[i][4] = done
            elif t <= -10:
                self.code[i][4] = starts[-t - 10]


def compile_program(tc: Any, sc: Any, sources: dict[int, list], wants: list[Any]) -> Program:
    """The program of one stream class; `sources` as tracesynth.io.ctf.decode._sources gives them."""
    refs = ref_names(
        tc.packet_header,
        sc.packet_context,
        sc.event_header,
        sc.event_context,
        *(e for ev in sc.events.values() for e in (ev.context, ev.payload)),
    )
    if sc.events and (min(sc.events) < 0 or max(sc.events) >= _MAX_IDS):
        raise FastUnsupported("event class ids too large for a table")
    c = _Compiler(refs)
    c.mode = "header"
    c.root(sc.event_header, "event.header", {})
    common = {
        m.split(":", 1)[1]
        for row in sources.values()
        for s in row
        if s and s[0] == "event.common_context"
        for m in [s[1]]
    }
    c.roots["event.common_context"] = {}
    c.root(sc.event_context, "event.common_context", {m: [("keep", -1)] for m in common})
    c.op(END)
    c.mode = "event"
    after_header = (c.known, c.res)
    evstart = np.full(max(sc.events, default=-1) + 1, -1, dtype=np.int64)
    for eid, ev in sc.events.items():
        evstart[eid] = c.label(*after_header)
        mine: dict[str, dict[str, list]] = {"event.context": {}, "event.payload": {}}
        for j, s in enumerate(sources[eid]):
            if s is not None and s[0] == "packet.context" and wants[j].kind != "int":
                raise FastUnsupported("a string from the packet context")
            if s is None or s[0] == "packet.context":
                continue
            member = s[1].split(":", 1)[1]
            if s[0] == "event.common_context":
                r = c.roots["event.common_context"].get((member,))
                if r is None:
                    raise FastUnsupported("a common context field that is not read")
                c.op(OUT if wants[j].kind == "int" else OUTS, r, j)
            else:
                mine[s[0]].setdefault(member, []).append((wants[j].kind, j))
        c.root(ev.context, "event.context", mine["event.context"])
        c.root(ev.payload, "event.payload", mine["event.payload"])
        c.op(END)
    try:
        code = np.array(c.code, dtype=np.int64).reshape(-1, 5)
    except OverflowError:  # a size or length in the metadata past int64: the Python decoder judges it
        raise FastUnsupported("a number in the metadata outside int64") from None
    return Program(code, evstart, next(iter(sc.events)) if len(sc.events) == 1 else 0, max(c.nregs, 1), len(wants))


def _read_int(buf, lim, q, sh, size, flags):  # noqa: ANN001, ANN202 - numba-compiled
    """(ok, value) of an integer of `size` bits at byte q, bit sh (CTF bit order)."""
    nb = (sh + size + 7) >> 3
    if q < 0 or q + nb > lim:
        return False, np.int64(0)
    v = np.uint64(0)
    if flags & 2:  # little-endian: the LSB first
        for i in range(nb):
            b = np.uint64(buf[q + i])
            s = 8 * i - sh
            if s >= 0:
                if s < 64:
                    v |= b << np.uint64(s)
            else:
                v |= b >> np.uint64(-s)
    else:
        if nb > 8:
            return False, np.int64(0)
        for i in range(nb):
            v = (v << np.uint64(8)) | np.uint64(buf[q + i])
        v >>= np.uint64(nb * 8 - sh - size)
    if size < 64:
        mask = (np.uint64(1) << np.uint64(size)) - np.uint64(1)
        v &= mask
        if flags & 1 and (v >> np.uint64(size - 1)) & np.uint64(1):
            v |= ~mask
    return True, np.int64(v)


def _leb(buf, lim, q, signed):  # noqa: ANN001, ANN202 - numba-compiled
    """(ok, value, next byte) of a LEB128 integer at byte q."""
    v = np.uint64(0)
    shift = 0
    while True:
        if q >= lim:
            return False, np.int64(0), q
        b = np.uint64(buf[q])
        q += 1
        if shift < 64:
            v |= (b & np.uint64(0x7F)) << np.uint64(shift)
        shift += 7
        if not b & np.uint64(0x80):
            break
        if shift > 70:
            return False, np.int64(0), q
    if signed and shift < 64 and (v >> np.uint64(shift - 1)) & np.uint64(1):
        v |= ~((np.uint64(1) << np.uint64(shift)) - np.uint64(1))
    return True, np.int64(v), q


def _data(buf, base, lim, p, op, a, b, c, d, regs):  # noqa: ANN001, ANN202, C901, PLR0911, PLR0912
    """The position after one data instruction (align, skip, read), or -1 where the bytes do not
    decode here (the Python decoder then redoes the packet)."""
    if op == ALIGN:
        return (p + a - 1) & -a if a > 1 else p
    if op == SKIP:
        return p + a
    if op == INT:
        ok, v = _read_int(buf, lim, base + (p >> 3), p & 7, a, b)
        if not ok:
            return -1
        regs[c] = v
        return p + a
    if p & 7 and op != SKIPN:  # LEB, CSTR, BYTES start on a byte
        return -1
    q = base + (p >> 3)
    if op == LEB:
        ok, v, q = _leb(buf, lim, q, b)
        if not ok:
            return -1
        if c >= 0:
            regs[c] = v
        return (q - base) << 3
    if op == CSTR:
        e = q
        while e < lim and buf[e] != 0:
            e += 1
        if e >= lim:
            return -1
        if c >= 0:
            regs[c], regs[c + 1] = q, e - q
        return (e + 1 - base) << 3
    m = regs[a] if a >= 0 else (b if op == BYTES else c)
    if m < 0:
        return -1
    if op == SKIPN:
        return p + b * m
    if m > lim - q:  # BYTES (q + m could wrap)
        return -1
    if c >= 0:
        e = q
        if d:  # text: up to the first NUL
            while e < q + m and buf[e] != 0:
                e += 1
        else:
            e = q + m
        regs[c], regs[c + 1] = q, e - q
    return p + 8 * m


def _run(buf, base, lim, p, end, clk, n, cap, code, evstart, default_id, regs, ts, ids, vals, lens, valid):  # noqa: ANN001, ANN202, C901, PLR0912
    """Decode the events of one packet (bytes base..lim of buf; p and end in bits from base) into
    rows n.. of the columns; returns (status, p, clk, n) to resume at."""
    while p < end:
        if n >= cap:
            return FULL, p, clk, n
        p0 = p
        eid = default_id
        pc = 0
        in_event = False
        while True:
            op, a, b, c, d = code[pc, 0], code[pc, 1], code[pc, 2], code[pc, 3], code[pc, 4]
            if op == END:
                if in_event:
                    break
                if eid < 0 or eid >= len(evstart) or evstart[eid] < 0:
                    return BAD, p, clk, n
                pc = evstart[eid]
                in_event = True
                continue
            if op <= SKIPN:
                p = _data(buf, base, lim, p, op, a, b, c, d, regs)
                if p < 0:
                    return BAD, p0, clk, n
            elif op == JIN:
                if b <= regs[a] <= c:
                    pc = d
                    continue
            elif op == JMP:
                pc = d
                continue
            elif op == FAIL:
                return BAD, p, clk, n
            elif op == CLOCK:
                v = np.uint64(regs[a])
                if c:
                    clk = v
                else:
                    mask = (np.uint64(1) << np.uint64(b)) - np.uint64(1)
                    if v < (clk & mask):
                        clk += mask + np.uint64(1)
                    clk = (clk & ~mask) | v
            elif op == SETID:
                eid = regs[a]
            elif op == OUT or op == OUTS:
                vals[b, n] = regs[a]
                valid[b, n] = 1
                if op == OUTS:
                    lens[b, n] = regs[a + 1]
            elif op == LOOP:
                m = regs[a] if a >= 0 else b
                if m > ((lim - base) << 3) - p + 1:
                    return BAD, p, clk, n
                if m <= 0:
                    pc = d
                    continue
                regs[c] = m
            elif op == NEXT:
                regs[a] -= 1
                if regs[a] > 0:
                    pc = d
                    continue
            pc += 1
        if p <= p0:
            return BAD, p, clk, n
        ts[n] = clk
        ids[n] = eid
        n += 1
    if p > end:
        return BAD, p, clk, n
    return OK, p, clk, n


def intern(buf, offs, lens, valid):  # noqa: ANN001, ANN201 - numba-compiled
    """Codes (first-seen order, -1 where not valid) of the byte strings buf[off:off+len], and the
    (offset, length) of each distinct one."""
    n = len(offs)
    nvalid = 0
    for i in range(n):  # the table for the strings there are (a column is mostly empty rows)
        if valid[i]:
            nvalid += 1
    size = 64
    while size < 2 * nvalid:
        size *= 2
    table = np.full(size, -1, dtype=np.int64)
    codes = np.full(n, -1, dtype=np.int32)
    first = np.zeros(nvalid, dtype=np.int64)
    k = 0
    for i in range(n):
        if not valid[i]:
            continue
        o, m = offs[i], lens[i]
        h = np.uint64(14695981039346656037)
        for j in range(m):
            h = (h ^ np.uint64(buf[o + j])) * np.uint64(1099511628211)
        slot = np.int64(h & np.uint64(size - 1))
        while True:
            c = table[slot]
            if c < 0:
                table[slot] = k
                first[k] = i
                codes[i] = k
                k += 1
                break
            f = first[c]
            if lens[f] == m:
                same = True
                for j in range(m):
                    if buf[offs[f] + j] != buf[o + j]:
                        same = False
                        break
                if same:
                    codes[i] = c
                    break
            slot = (slot + 1) & (size - 1)
    return codes, first[:k]


def first_seen(codes, k):  # noqa: ANN001, ANN201 - numba-compiled
    """Codes renumbered in order of first appearance (-1 kept), and the old code of each new one."""
    remap = np.full(k, -1, dtype=np.int32)
    order = np.zeros(k, dtype=np.int64)
    out = np.empty(len(codes), dtype=np.int32)
    m = 0
    for i in range(len(codes)):
        c = codes[i]
        if c < 0:
            out[i] = -1
            continue
        if remap[c] < 0:
            remap[c] = m
            order[m] = c
            m += 1
        out[i] = remap[c]
    return out, order[:m]


def carry(key, mark, at, at2, after, after2, state, state2, out, out2):  # noqa: ANN001, ANN201 - numba-compiled
    """Per key (a CPU; -1 for none) the pair (value, value2) set by its latest marked row, carried
    from `state`/`state2` (indexed by key, updated in place): the j-th marked row (a sched_switch)
    gets `at[j]`/`at2[j]` (the task switching out) and sets its key's state to `after[j]`/`after2[j]`
    (the task switching in); any other row gets its key's state; a row without a key gets -1."""
    j = 0
    for i in range(len(key)):
        k = key[i]
        if mark[i]:
            if k < 0:
                out[i] = -1
                out2[i] = -1
            else:
                out[i] = at[j]
                out2[i] = at2[j]
                state[k] = after[j]
                state2[k] = after2[j]
            j += 1
        elif k < 0:
            out[i] = -1
            out2[i] = -1
        else:
            out[i] = state[k]
            out2[i] = state2[k]


CORES = ("cython", "numba", "python")
_ABI = 3  # tracesynth.io.ctf._core.ABI this file expects (a stale build is not used)
# per choice ("auto" or a core): its kernels, or None; "k": the kernels of the latest read
_KERNELS: dict[str, Any] = {}


def choice() -> str:
    """TRACESYNTH_CTF_CORE: "auto" (unset), "cython", "numba" or "python"."""
    name = (os.environ.get("TRACESYNTH_CTF_CORE") or "auto").strip().lower()
    if name not in ("auto", *CORES):
        raise TraceSynthError(
            f"unknown CTF core {name!r} in TRACESYNTH_CTF_CORE (choose from auto, {', '.join(CORES)})"
        )
    return name


def cheap() -> bool:
    """Whether the compiled core `kernels` would give loads at no real cost (the Cython one), so
    that even a small trace is worth it; numba's load is not (nothing is imported here)."""
    return choice() in ("auto", "cython") and _cython() is not None


def kernels() -> SimpleNamespace | None:
    """The compiled functions (`name`: "cython" or "numba"), by TRACESYNTH_CTF_CORE's choice, or
    None where no compiled core loads (a warning; the Python decoder reads everything then)."""
    want = choice()
    if want not in _KERNELS:
        k = None
        errors = []
        for name in ("cython", "numba") if want == "auto" else (want,) if want != "python" else ():
            k, err = _load(name)
            if k is not None:
                break
            if err or want != "auto":  # one asked for by name is missed even where not installed
                errors.append(err or f"{name}: not installed")
        if k is None and errors:
            warnings.warn(
                f"the compiled CTF core is unavailable ({'; '.join(errors)}); decoding in Python", stacklevel=2
            )
        _KERNELS[want] = k
    _KERNELS["k"] = _KERNELS[want]
    return _KERNELS["k"]


def _cython() -> Any:
    try:
        from tracesynth.io.ctf import _core
    except ImportError:
        return None
    return _core if getattr(_core, "ABI", None) == _ABI else None


def _load(name: str) -> tuple[SimpleNamespace | None, str]:
    """(kernels, "") or (None, why not: "" where the core is simply not installed)."""
    if name == "cython":
        core = _cython()
        if core is None:
            return None, ""
        if tuple(core.OPCODES) != tuple(range(NEXT + 1)) or tuple(core.STATUSES) != (OK, FULL, BAD):
            return None, "cython: another instruction set"
        k = SimpleNamespace(
            name="cython", run=core.run, intern=core.intern, first_seen=core.first_seen, carry=core.carry
        )
    else:
        try:
            from numba import njit
        except ImportError:  # numba is a dependency of the tracesynth extra; without it, Python
            return None, ""
        jit = njit(cache=True, nogil=True)
        g = globals()
        for fn in ("_read_int", "_leb", "_data"):  # _run calls them: they are compiled first
            g[fn] = jit(getattr(g[fn], "py_func", g[fn]))
        k = SimpleNamespace(
            name="numba", run=jit(_run), intern=jit(intern), first_seen=jit(first_seen), carry=jit(carry)
        )
    try:  # compiled (or loaded from numba's cache) here, once, rather than in the middle of a trace
        _warm_up(k)
    except Exception as exc:  # noqa: BLE001 - any failure: fall back, never crash a read
        return None, f"{name}: {type(exc).__name__}"
    return k, ""


def _warm_up(k: SimpleNamespace) -> None:
    z8, z64 = np.frombuffer(bytes(8), dtype=np.uint8), np.zeros(1, dtype=np.int64)  # read-only, as a mapped file
    k.first_seen(np.zeros(1, dtype=np.int32), 1)
    k.intern(z8, z64, z64, np.zeros(1, dtype=np.uint8))
    z32 = np.zeros(1, dtype=np.int32)  # carry's types as tracesynth.io.lttng passes them
    k.carry(z64, np.ones(1, dtype=np.uint8), z64, z32, z64, z32, z64.copy(), z32.copy(), z64.copy(), z32.copy())
    code = np.zeros((1, 5), dtype=np.int64)  # END at once: no event read
    cols = (
        z64.copy(),
        np.zeros(1, dtype=np.uint64),
        z64.copy(),
        np.zeros((1, 1), np.int64),
        np.zeros((1, 1), np.int64),
    )
    k.run(z8, 0, 8, 0, 0, np.uint64(0), 0, 1, code, z64.copy(), 0, *cols, np.zeros((1, 1), dtype=np.uint8))


def loaded() -> SimpleNamespace | None:
    """The compiled functions the latest read chose, if it needed them (nothing is imported here)."""
    return _KERNELS.get("k")


def run_packet(
    prog: Program, buf: np.ndarray, base: int, lim: int, p: int, end: int, clk: int, n: int, out: Any
) -> tuple:
    """One packet's events (or as many as `out` holds) into `out`'s columns at row n."""
    cols = (out.regs, out.ts, out.ids, out.vals, out.lens, out.valid)
    return _KERNELS["k"].run(
        buf, base, lim, p, end, np.uint64(clk), n, len(out.ts), prog.code, prog.evstart, prog.default_id, *cols
    )
