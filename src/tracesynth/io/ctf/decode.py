"""Decode CTF data streams with decoders compiled per stream class (tracesynth.io.ctf.compile).

For each stream class one Python module is generated: a packet function (packet header and
context: sizes, stream class, clock at the packet's beginning, cpu_id and requested fields), a
loop over a packet's events (event header and common context inline, the clock extended on
wrap-around as babeltrace2 extends it) and one function per event class (its specific context
and payload: sizes skipped, requested fields read).
"""

from __future__ import annotations

import fnmatch
import re
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any

from tracesynth.io.ctf.compile import CtfDecodeError, Emitter, exec_source, field_kind, ref_names, static_size
from tracesynth.io.ctf.model import EventClass, Int, StreamClass, Struct, TraceClass

PACKET_MAGIC = 0xC1FC1FC1
_PACKET_ROLES = ("magic", "stream_id", "stream_instance_id", "content_size", "packet_size")
# where a Field of each scope may be found, in the order babeltrace2 prints the scopes
SCOPE_ROOTS = {
    "context": ("event.common_context", "event.context", "packet.context"),
    "payload": ("event.payload",),
    "any": ("packet.context", "event.common_context", "event.context", "event.payload"),
    "packet": ("packet.context",),
}


@dataclass
class Want:
    """A value to extract: `name` as babeltrace2 prints it, `kind` int or str, event patterns."""

    name: str
    kind: str = "int"
    scope: str = "any"
    events: tuple[str, ...] | None = None


def member_names(fc: Struct | None, strip: bool) -> dict[str, tuple[str, Any]]:
    """Printed name -> (member name, class) of a scope's top-level members (CTF 1.8's one leading
    underscore dropped, as babeltrace2 prints it)."""
    if fc is None:
        return {}
    out: dict[str, tuple[str, Any]] = {}
    for n, f in fc.fields:
        shown = n[1:] if strip and n.startswith("_") else n
        out.setdefault(shown, (n, f))
    return out


class _ScopeEmitter(Emitter):
    """An emitter that acts on meaningful integers: event id, clock values, packet sizes."""

    def __init__(self, ns: dict[str, Any], refs: set[str], mode: str, indent: int = 1) -> None:
        super().__init__(ns, refs, indent)
        self.mode = mode  # "packet", "header" or "event"

    def int_needs(self, fc: Int) -> bool:
        if self.mode == "packet":
            return fc.role in _PACKET_ROLES or fc.clock is not None
        if self.mode == "header":
            return fc.role == "id" or fc.clock is not None
        return False

    def int_hook(self, fc: Int, v: str) -> None:
        if self.mode == "packet" and fc.role in _PACKET_ROLES:
            self.emit(f"R[{fc.role!r}] = {v}")
        if self.mode == "header" and fc.role == "id":
            self.emit(f"_id = {v}")
        if fc.clock is not None and self.mode in ("packet", "header"):
            if fc.size >= 64 and not fc.varlen:
                self.emit(f"clk = {v}")
            else:
                mask = (1 << fc.size) - 1
                self.emit(f"if {v} < (clk & {mask}):")
                self.emit(f"    clk += {mask + 1}")
                self.emit(f"clk = (clk & {~mask}) | {v}")

    def root(self, fc: Struct | None, root: str, want: dict[str, str]) -> dict[str, str]:
        """Code for a root scope; `want`: member name -> slot. Returns slot -> variable."""
        table: dict[tuple[str, ...], str] = {}
        self.roots[root] = table
        if fc is None:
            return {}
        self.align(max(fc.align, 1))
        self.scopes.append(table)
        got = {}
        for n, f in fc.fields:
            v = self.field(f, n, keep=n in want)
            if n in want and v is not None:
                got[want[n]] = v
        self.scopes.pop()
        return got


@dataclass
class StreamDecoder:
    """The compiled decoders of one stream class and what each event class extracts."""

    sc: StreamClass
    packet: Any
    run: Any
    # slot layout: per Want index, where its value comes from for each event class id
    sources: dict[int, list[tuple[str, int] | None]]
    n_packet: int
    n_common: int
    records: dict[int, list[tuple]] = field(default_factory=dict)
    common: list[tuple] = field(default_factory=list)


_WILDCARD = re.compile(r"[*?[]")  # fnmatch's special characters


def _patterns(pats: Any) -> Any:
    """A match function that is true where fnmatch.fnmatchcase is for one of `pats`: names without a
    wildcard by a set lookup (translating and compiling ~100 escaped event names took ~8 ms a read)."""
    literal = frozenset(p for p in pats if not _WILDCARD.search(p))
    wild = [p for p in pats if p not in literal]
    if not wild:
        return literal.__contains__
    rx = re.compile("|".join(map(fnmatch.translate, wild))).match
    return lambda name: name in literal or rx(name) is not None


def _sources(tc: TraceClass, sc: StreamClass, wants: list[Want]) -> tuple[dict[int, list], dict, dict, dict]:
    """For each event class, where each Want comes from: (level, member) or None."""
    strip = tc.version != "2"
    stream_scopes = {
        "packet.context": member_names(sc.packet_context, strip),
        "event.common_context": member_names(sc.event_context, strip),
    }
    need: dict[str, dict[str, str]] = {"packet.context": {}, "event.common_context": {}}
    per_event: dict[int, dict[str, dict[str, str]]] = {}
    sources: dict[int, list] = {}
    # each Want's event-name patterns as one regex (fnmatchcase's own translation), not a call per pattern
    # and event class: an LTTng kernel trace has ~1500 event classes
    match = [None if w.events is None else _patterns(w.events) for w in wants]
    for eid, ev in sc.events.items():
        scopes = {
            **stream_scopes,
            "event.context": member_names(ev.context, strip),
            "event.payload": member_names(ev.payload, strip),
        }
        row: list = []
        mine: dict[str, dict[str, str]] = {"event.context": {}, "event.payload": {}}
        for w, m in zip(wants, match, strict=True):
            src = None
            if m is None or m(ev.name):
                for root in SCOPE_ROOTS[w.scope]:
                    hit = scopes[root].get(w.name)
                    if hit is not None and field_kind(hit[1]) == w.kind:
                        table = need[root] if root in need else mine[root]
                        slot = table.setdefault(hit[0], f"{root}:{hit[0]}")
                        src = (root, slot)
                        break
            row.append(src)
        sources[eid] = row
        per_event[eid] = mine
    return sources, need, per_event, stream_scopes


def compile_stream(tc: TraceClass, sc: StreamClass, wants: list[Want]) -> StreamDecoder:
    """Generate and compile the decoders of one stream class."""
    sources, need, per_event, _ = _sources(tc, sc, wants)
    ns: dict[str, Any] = {}
    refs = ref_names(
        tc.packet_header,
        sc.packet_context,
        sc.event_header,
        sc.event_context,
        *(e for ev in sc.events.values() for e in (ev.context, ev.payload)),
    )
    src: list[str] = []
    # packet header and context
    pk_slots = sorted(need["packet.context"].items())
    e = _ScopeEmitter(ns, refs, "packet")
    e.emit("p = 0")
    e.emit("R = {}")
    e.root(tc.packet_header, "packet.header", {})
    got = e.root(sc.packet_context, "packet.context", {m: s for m, s in pk_slots})
    e.flush()
    vals = ", ".join(got.get(s, "None") for _, s in pk_slots)
    e.emit(f"return p, clk, R, ({vals}{',' if pk_slots else ''})")
    src += ["def packet(buf, clk):", *e.lines, ""]
    # the event loop: header and common context inline, then the event class's function
    co_slots = sorted(need["event.common_context"].items())
    e = _ScopeEmitter(ns, refs, "header", indent=2)
    only = next(iter(sc.events)) if len(sc.events) == 1 else 0
    e.emit(f"_id = {only}")
    hs = static_size(sc.event_header) if sc.event_header is not None else None
    may_be_empty = hs is None or hs[0] == 0  # an event of no size would loop forever
    if may_be_empty:
        e.emit("p0 = p")
    e.root(sc.event_header, "event.header", {})
    got = e.root(sc.event_context, "event.common_context", {m: s for m, s in co_slots})
    e.flush()
    if co_slots:
        e.emit(f"C(({', '.join(['n', *(got.get(s, 'None') for _, s in co_slots)])},))")
    e.emit("try:")
    e.emit("    f = EV[_id]")
    e.emit("except KeyError:")
    e.emit("    raise CtfDecodeError('event record class id %d is not in the metadata' % _id) from None")
    # an event class of fixed size nobody reads a field of is skipped by its size (an int in EV)
    e.emit("if f.__class__ is int:")
    e.emit("    p += f")
    e.emit("else:")
    e.emit("    p = f(buf, p, n)")
    if may_be_empty:
        e.emit("if p <= p0:")
        e.emit("    raise CtfDecodeError('an event record of no size')")
    body_state = (e.known, e.res)
    e.emit("T(clk)")
    e.emit("I(_id)")
    e.emit("n += 1")
    src += [
        "def run(buf, p, end, clk, n, T, I, C):",
        "    while p < end:",
        *e.lines,
        "    if p > end:",
        "        raise CtfDecodeError('an event record crosses the end of its packet')",
        "    return clk, n",
        "",
    ]
    records: dict[int, list[tuple]] = {}
    evfuncs: dict[int, str] = {}
    for eid, ev in sc.events.items():
        fname = f"ev_{len(evfuncs)}"
        evfuncs[eid] = fname
        src += _event_source(ns, refs, e.roots, ev, per_event[eid], fname, records)
    ns["EV_NAMES"] = evfuncs
    glb = exec_source("\n".join(src), ns)
    glb["EV"] = {eid: _fixed_size(ev, body_state, per_event[eid]) for eid, ev in sc.events.items()}
    for eid, f in evfuncs.items():
        if glb["EV"][eid] is None:
            glb["EV"][eid] = glb[f]
    dec = StreamDecoder(sc, glb["packet"], glb["run"], sources, len(pk_slots), len(co_slots), records)
    dec.slots = {"packet": [s for _, s in pk_slots], "common": [s for _, s in co_slots]}  # type: ignore[attr-defined]
    return dec


def _fixed_size(ev: EventClass, state: tuple[int, int], mine: dict[str, dict[str, str]]) -> int | None:
    """The size in bits of an event class's context and payload when it is the same for every
    event (fixed layout, nothing to read, aligned already where the event header ends)."""
    if mine["event.context"] or mine["event.payload"]:
        return None
    total = 0
    for fc in (ev.context, ev.payload):
        if fc is None:
            continue
        st = static_size(fc)
        if st is None or state[0] < st[1] or (state[1] + total) % st[1]:
            return None
        total += st[0]
    return total


def _event_source(
    ns: dict[str, Any],
    refs: set[str],
    stream_roots: dict,
    ev: EventClass,
    mine: dict[str, dict[str, str]],
    fname: str,
    records: dict[int, list],
) -> list[str]:
    """The function decoding one event class's specific context and payload."""
    e = _ScopeEmitter(ns, refs, "event")
    e.roots.update(stream_roots)
    got = e.root(ev.context, "event.context", mine["event.context"])
    got.update(e.root(ev.payload, "event.payload", mine["event.payload"]))
    e.flush()
    slots = [*mine["event.context"].values(), *mine["event.payload"].values()]
    if slots:
        rec: list[tuple] = []
        records[ev.id] = rec
        ns[f"R_{fname}"] = rec.append
        e.emit(f"R_{fname}(({', '.join(['n', *(got.get(s, 'None') for s in slots)])},))")
        ns[f"S_{fname}"] = slots
    e.emit("return p")
    return [f"def {fname}(buf, p, n):", *e.lines, ""]


@dataclass
class StreamData:
    """What one stream file decoded to."""

    decoder: StreamDecoder
    ts: array  # raw clock values, one per event
    ids: array  # event class ids
    packets: list[tuple[int, int, tuple]]  # (first row, rows, packet values)
    instance: int | None
    common: list[tuple] = field(default_factory=list)
    records: dict[int, list[tuple]] = field(default_factory=dict)


def decode_file(
    tc: TraceClass, decoders: dict[int, StreamDecoder], data: bytes, base: int = 0, clk: int = 0
) -> StreamData:
    """Decode every packet of one stream file, or of its bytes from `base` on, the clock at `clk`
    (CtfDecodeError naming the packet's byte offset in the file)."""
    pos, n = 0, 0
    ts, ids = array("Q"), array("q")
    packets: list[tuple[int, int, tuple]] = []
    common: list[tuple] = []
    dec = None
    instance = None
    while pos < len(data):
        try:
            head = data[pos : pos + 4096]
            try:
                p, clk, roles, pvals = _packet_head(tc, decoders, head, clk)
            except (IndexError, CtfDecodeError, struct.error):
                head = data[pos:]
                p, clk, roles, pvals = _packet_head(tc, decoders, head, clk)
            d = decoders[roles.get("stream_id", next(iter(decoders)) if len(decoders) == 1 else 0)]
            if dec is not None and d is not dec:
                raise CtfDecodeError("packets of different stream classes in one stream file")
            if dec is None:
                dec = d
                for rec in d.records.values():
                    rec.clear()
            instance = roles.get("stream_instance_id", instance)
            size = roles.get("packet_size", roles.get("content_size", (len(data) - pos) * 8))
            content = roles.get("content_size", size)
            if size <= 0 or size % 8 or content > size or pos + size // 8 > len(data) or content < p:
                raise CtfDecodeError(f"packet sizes (content {content} bits, packet {size} bits) do not fit the file")
            buf = data[pos : pos + size // 8]
            first = n
            clk, n = d.run(buf, p, content, clk, n, ts.append, ids.append, common.append)
            packets.append((first, n - first, pvals))
        except CtfDecodeError as exc:
            raise CtfDecodeError(f"packet at byte {base + pos}: {exc}") from None
        except (IndexError, ValueError, KeyError, NameError, OverflowError, TypeError, struct.error) as exc:
            raise CtfDecodeError(f"packet at byte {base + pos}: cannot decode ({type(exc).__name__}: {exc})") from None
        pos += size // 8
    if dec is None:
        dec = next(iter(decoders.values()))
    records = {k: list(v) for k, v in dec.records.items()}
    for v in dec.records.values():
        v.clear()
    return StreamData(dec, ts, ids, packets, instance, common, records)


def _packet_head(tc: TraceClass, decoders: dict[int, StreamDecoder], head: bytes, clk: int) -> tuple:
    """Decode a packet's header (with whichever stream class's packet function: the header is the
    trace's) and then its context with its own stream class's."""
    any_dec = next(iter(decoders.values()))
    p, clk2, roles, pvals = any_dec.packet(head, clk)
    if "magic" in roles and roles["magic"] != PACKET_MAGIC:
        raise CtfDecodeError(f"bad packet magic {roles['magic']:#x}")
    sid = roles.get("stream_id")
    if sid is not None and sid not in decoders:
        raise CtfDecodeError(f"stream class {sid} is not in the metadata")
    if sid is not None and decoders[sid] is not any_dec:
        p, clk2, roles, pvals = decoders[sid].packet(head, clk)
    return p, clk2, roles, pvals
