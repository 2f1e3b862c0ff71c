"""Compile field classes into Python functions that decode them at fixed offsets.

A decoder works on a packet's bytes and a bit position `p`. While generating code the compiler
tracks what it knows statically (the alignment of `p`, and a pending constant offset not yet
added to it), so a run of byte-aligned fields becomes a few `unpack_from` calls at constant
offsets, and fields nobody asked for are skipped by adding their size instead of being read.
Values are read only for what decoding needs (event ids, clock values, lengths and selectors)
and for the fields the caller asked for.
"""

from __future__ import annotations

import struct
from typing import Any

from tracesynth.io.ctf.model import Array, Blob, Float, Int, Optional, Ref, String, Struct, Variant


class CtfDecodeError(ValueError):
    """The data does not decode with its metadata (damaged or truncated stream)."""


class Unsupported(ValueError):
    """The metadata uses a layout this compiler does not handle."""


def lookup_ref(ref: Ref, roots: dict, scopes: list, error: type[Exception]) -> Any:
    """What a length or selector reference names: in its root scope when it has one, else the innermost scope
    that holds its path (the enclosing structures first, then the roots, innermost first), as CTF resolves it."""
    if ref.root is not None:
        table = roots.get(ref.root)
        if table is None or ref.path not in table:
            raise error(f"reference {ref.root}.{'.'.join(ref.path)} is out of reach")
        return table[ref.path]
    for table in [*reversed(scopes), *reversed(list(roots.values()))]:
        if ref.path in table:
            return table[ref.path]
    raise error(f"unresolved reference {'.'.join(ref.path)!r}")


def _lowbit(x: int) -> int:
    return x & -x if x else 1 << 30


def static_size(fc: Any) -> tuple[int, int] | None:
    """(bits, alignment) of a fixed-size field class whose layout is the same wherever it starts
    (aligned), or None."""
    if isinstance(fc, Int):
        return None if fc.varlen else (fc.size, max(fc.align, 1))
    if isinstance(fc, Float):
        return fc.size, max(fc.align, 1)
    if isinstance(fc, Struct):
        off, al = 0, max(fc.align, 1)
        for _, f in fc.fields:
            s = static_size(f)
            if s is None:
                return None
            off = -(-off // s[1]) * s[1] + s[0]
            al = max(al, s[1])
        return off, al
    if isinstance(fc, Array) and isinstance(fc.length, int):
        s = static_size(fc.element)
        if s is None or s[0] % s[1]:
            return None
        return s[0] * fc.length, max(s[1], fc.align, 1)
    if isinstance(fc, Blob) and isinstance(fc.length, int):
        return fc.length * 8, max(fc.align, 8)
    if isinstance(fc, String) and isinstance(fc.length, int):
        return fc.length * 8, 8
    return None


def is_text(fc: Any) -> bool:
    """An array of 8-bit encoded integers: babeltrace2 shows it as a string."""
    return isinstance(fc, Array) and isinstance(fc.element, Int) and fc.element.size == 8 and bool(fc.element.encoding)


def field_kind(fc: Any) -> str | None:
    """'int' or 'str' for a field a column can hold, else None."""
    if isinstance(fc, Int):
        return "int"
    if isinstance(fc, String) or is_text(fc):
        return "str"
    return None


def _bits(buf: Any, pos: int, size: int, little: bool, signed: bool) -> int:
    """An integer of `size` bits at bit `pos` (CTF bit order: LSB first in little-endian)."""
    q, sh = pos >> 3, pos & 7
    nb = (sh + size + 7) >> 3
    if q + nb > len(buf):
        raise CtfDecodeError("a field runs past the end of the packet")
    if little:
        v = (int.from_bytes(buf[q : q + nb], "little") >> sh) & ((1 << size) - 1)
    else:
        v = (int.from_bytes(buf[q : q + nb], "big") >> (nb * 8 - sh - size)) & ((1 << size) - 1)
    if signed and v >> (size - 1):
        v -= 1 << size
    return v


def _leb128(buf: Any, q: int, signed: bool) -> tuple[int, int]:
    """(value, next byte) of a LEB128 integer at byte q."""
    v = shift = 0
    while True:
        if q >= len(buf):
            raise CtfDecodeError("a variable-length integer runs past the end of the packet")
        b = buf[q]
        q += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
        if shift > 70:
            raise CtfDecodeError("a variable-length integer is too long")
    if signed and v >> (shift - 1) & 1:
        v -= 1 << shift
    return v & 0xFFFFFFFFFFFFFFFF if not signed else v, q


def _cstr(buf: Any, q: int) -> int:
    """The byte index of the NUL that ends the string at byte q."""
    e = buf.find(b"\0", q)
    if e < 0:
        raise CtfDecodeError("a string runs past the end of the packet")
    return e


def _text(raw: bytes) -> bytes:
    e = raw.find(b"\0")
    return raw if e < 0 else raw[:e]


_NS: dict[str, Any] = {
    "_bits": _bits,
    "_leb128": _leb128,
    "_cstr": _cstr,
    "_text": _text,
    "CtfDecodeError": CtfDecodeError,
}
_FMT = {8: "B", 16: "H", 32: "I", 64: "Q"}
_FMT_BYTES = (1, 2, 4, 8)


class Emitter:
    """Generates the body of one decoding function."""

    def __init__(self, ns: dict[str, Any], refs: set[str], indent: int = 1) -> None:
        self.ns = ns  # the generated module's globals (struct unpackers, tables)
        self.refs = refs  # names read by some length/selector reference: their values are kept
        self.lines: list[str] = []
        self.ind = indent
        self.pend = 0  # bits known to follow p, not yet added to it
        self.known = 1  # an alignment p is known to have...
        self.res = 0  # ...up to this remainder: p % known == res
        self.nvar = 0
        self.scopes: list[dict[tuple[str, ...], str]] = []
        self.roots: dict[str, dict[tuple[str, ...], str]] = {}

    # -- code and state -----------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append("    " * self.ind + line)

    def var(self, stem: str = "v") -> str:
        self.nvar += 1
        return f"{stem}{self.nvar}"

    def flush(self) -> None:
        if self.pend:
            self.emit(f"p += {self.pend}")
            self.res = (self.res + self.pend) % self.known
            self.pend = 0

    def set_state(self, known: int, res: int = 0) -> None:
        self.known, self.res = known, res % known

    def align(self, a: int) -> None:
        if a <= 1:
            return
        if self.known >= a:
            self.pend += -(self.res + self.pend) % a
        else:
            self.flush()
            self.emit(f"p = (p + {a - 1}) & {-a}")
            self.set_state(a)

    def pos(self) -> str:
        return f"p + {self.pend}" if self.pend else "p"

    def bit_pos(self) -> tuple[str, int] | None:
        """(byte index expression, bit shift) of the current position when its bit offset inside a
        byte is known statically."""
        if self.known < 8:
            return None
        r0 = self.res % 8
        k = (r0 + self.pend) >> 3
        return (f"(p >> 3) + {k}" if k else "(p >> 3)"), (r0 + self.pend) & 7

    def byte_pos(self) -> str | None:
        """The byte index of the current position when it is statically byte aligned."""
        bp = self.bit_pos()
        return bp[0] if bp is not None and bp[1] == 0 else None

    # -- references ---------------------------------------------------------------------------
    def lookup(self, ref: Ref) -> str:
        return lookup_ref(ref, self.roots, self.scopes, Unsupported)

    def bind(self, name: str | None, var: str) -> None:
        if name is not None and self.scopes:
            self.scopes[-1][(name,)] = var

    # -- field classes ------------------------------------------------------------------------
    def integer(self, fc: Int, keep: bool) -> str | None:
        """Read (keep) or skip an integer; returns the variable holding it."""
        if fc.varlen:
            self.align(8)
            self.flush()
            v = self.var()
            self.emit(f"{v}, q = _leb128(buf, p >> 3, {fc.signed})")
            self.emit("p = q << 3")
            self.set_state(8)
            return v if keep else None
        self.align(fc.align)
        if not keep:
            self.pend += fc.size
            return None
        v = self.var()
        bp = self.bit_pos()
        nb = None if bp is None else (bp[1] + fc.size + 7) >> 3
        if bp is not None and nb in _FMT_BYTES:
            fmt = ("<" if fc.little else ">") + _FMT[nb * 8]
            signed = fc.signed and bp[1] == 0 and fc.size == nb * 8
            if signed:
                fmt = fmt.lower()
            name = "_u_" + fmt.replace("<", "l").replace(">", "b")
            self.ns[name] = struct.Struct(fmt).unpack_from
            self.emit(f"{v}, = {name}(buf, {bp[0]})")
            shift = bp[1] if fc.little else nb * 8 - bp[1] - fc.size
            if fc.size < nb * 8:
                self.emit(f"{v} = ({v} >> {shift}) & {(1 << fc.size) - 1}" if shift else f"{v} &= {(1 << fc.size) - 1}")
            if fc.signed and not signed:
                self.emit(f"if {v} >> {fc.size - 1}:")
                self.emit(f"    {v} -= {1 << fc.size}")
        else:
            self.emit(f"{v} = _bits(buf, {self.pos()}, {fc.size}, {fc.little}, {fc.signed})")
        self.pend += fc.size
        return v

    def string(self, fc: String, keep: bool) -> str | None:
        self.align(8)
        if isinstance(fc.length, int):
            return self.raw_bytes(fc.length, keep, text=True)
        if isinstance(fc.length, Ref):
            return self.dyn_bytes(self.lookup(fc.length), keep, text=True)
        self.flush()
        e = self.var("e")
        self.emit(f"{e} = _cstr(buf, p >> 3)")
        v = None
        if keep:
            v = self.var()
            self.emit(f"{v} = buf[p >> 3:{e}]")
        self.emit(f"p = ({e} + 1) << 3")
        self.set_state(8)
        return v

    def raw_bytes(self, n: int, keep: bool, text: bool) -> str | None:
        bp = self.byte_pos()
        v = None
        if keep:
            if bp is None:
                raise Unsupported("a string that is not byte aligned")
            v = self.var()
            self.emit(f"{v} = _text(buf[{bp}:{bp} + {n}])" if text else f"{v} = buf[{bp}:{bp} + {n}]")
        self.pend += 8 * n
        return v

    def dyn_bytes(self, n: str, keep: bool, text: bool) -> str | None:
        self.flush()
        v = None
        if keep:
            v = self.var()
            self.emit(f"{v} = _text(buf[p >> 3:(p >> 3) + {n}])" if text else f"{v} = buf[p >> 3:(p >> 3) + {n}]")
        self.emit(f"p += 8 * {n}")
        self.set_state(8)
        return v

    def field(self, fc: Any, name: str | None, keep: bool = False) -> str | None:
        """Code for one field; returns the variable holding its value when kept."""
        keep = keep or (name is not None and name in self.refs)
        if isinstance(fc, Int):
            hook = self.int_needs(fc)
            v = self.integer(fc, keep or hook)
            if v is not None:
                self.bind(name, v)
                self.scopes[-1][("#fc", name or "")] = fc  # type: ignore[assignment]
                if hook:
                    self.int_hook(fc, v)
            return v
        if isinstance(fc, Float):
            self.align(fc.align)
            self.pend += fc.size
            return None
        if isinstance(fc, String):
            return self.string(fc, keep)
        if isinstance(fc, Blob):
            self.align(max(fc.align, 8))
            if isinstance(fc.length, int):
                return self.raw_bytes(fc.length, False, text=False)
            return self.dyn_bytes(self.lookup(fc.length), False, text=False)
        if isinstance(fc, Struct):
            return self.struct(fc, name)
        if isinstance(fc, Array):
            return self.array(fc, keep)
        if isinstance(fc, Variant | Optional):
            self.choice(fc, name)
            return None
        raise Unsupported(f"unknown field class {type(fc).__name__}")

    def int_needs(self, fc: Int) -> bool:
        return False

    def int_hook(self, fc: Int, v: str) -> None:
        pass

    def struct(self, fc: Struct, name: str | None) -> None:
        self.align(align_of(fc))
        self.scopes.append({})
        for n, f in fc.fields:
            self.field(f, n)
        inner = self.scopes.pop()
        if name is not None and self.scopes:
            for k, v in inner.items():
                if k[0] != "#fc":
                    self.scopes[-1][(name, *k)] = v
        return None

    def array(self, fc: Array, keep: bool) -> str | None:
        n = fc.length if isinstance(fc.length, int) else self.lookup(fc.length)
        self.align(max(fc.align, align_of(fc.element)))
        if is_text(fc):
            if isinstance(n, int):
                return self.raw_bytes(n, keep, text=True) if self.byte_pos() else self._skip_array(fc, n)
            return self.dyn_bytes(n, keep, text=True)
        return self._skip_array(fc, n)

    def _skip_array(self, fc: Array, n: int | str) -> None:
        s = static_size(fc.element)
        if s is not None and s[0] % s[1] == 0 and not self._has_refs(fc.element):
            if isinstance(n, int):
                self.pend += s[0] * n
            else:
                self.flush()
                self.emit(f"p += {s[0]} * {n}")
                self.set_state(min(self.known, _lowbit(s[0])), self.res)
            return None
        self.flush()
        self.emit(f"if {n} > (len(buf) << 3) - p + 1:")
        self.emit("    raise CtfDecodeError('an array is longer than its packet')")
        self.emit(f"for _ in range({n}):")
        self.ind += 1
        start = len(self.lines)
        self.set_state(1)
        self.scopes.append({})
        self.field(fc.element, None)
        self.scopes.pop()
        self.flush()
        if len(self.lines) == start:
            self.emit("pass")
        self.ind -= 1
        self.set_state(1)
        return None

    def _has_refs(self, fc: Any) -> bool:
        if isinstance(fc, Struct):
            return any(n in self.refs or self._has_refs(f) for n, f in fc.fields)
        return isinstance(fc, Array) and self._has_refs(fc.element)

    def choice(self, fc: Variant | Optional, name: str | None) -> None:
        sel = self.lookup(fc.selector)
        sel_fc = self._selector_class(fc.selector)
        if isinstance(fc, Optional):
            branches = [(fc.ranges, fc.element, None)]
        else:
            branches = [(r if r is not None else _label_ranges(sel_fc, n), f, n) for n, f, r in fc.options]
        self.flush()
        k0, r0, ends, first = self.known, self.res, [], True
        for ranges, f, oname in branches:
            cond = (
                sel
                if ranges is None
                else " or ".join(f"{sel} == {lo}" if lo == hi else f"{lo} <= {sel} <= {hi}" for lo, hi in ranges)
                or "False"
            )
            self.emit(f"{'if' if first else 'elif'} {cond}:")
            first = False
            self.ind += 1
            start = len(self.lines)
            self.set_state(k0, r0)
            self.scopes.append({})
            self.field(f, oname)
            inner = self.scopes.pop()
            if name is not None:
                self.scopes[-1].update({(name, *k): v for k, v in inner.items() if k[0] != "#fc"})
            self.flush()
            ends.append((self.known, self.res))
            if len(self.lines) == start:
                self.emit("pass")
            self.ind -= 1
        if isinstance(fc, Variant):
            self.emit("else:")
            self.emit(f"    raise CtfDecodeError('variant selector value %r matches no option' % ({sel},))")
        else:
            ends.append((k0, r0))
        a = min(k for k, _ in ends)
        while a > 1 and len({r % a for _, r in ends}) > 1:
            a //= 2
        self.set_state(a, ends[0][1])

    def _selector_class(self, ref: Ref) -> Int | None:
        tables = [self.roots.get(ref.root, {})] if ref.root else [*reversed(self.scopes), *self.roots.values()]
        for t in tables:
            fc = t.get(("#fc", ref.path[-1])) if len(ref.path) == 1 else None
            if fc is not None:
                return fc  # type: ignore[return-value]
        return None


def _label_ranges(sel_fc: Int | None, option: str) -> list[tuple[int, int]]:
    """The selector values that pick a TSDL variant option: its enum labels equal to the option's
    name (a leading underscore on either side ignored, as babeltrace2 does)."""
    if sel_fc is None or not sel_fc.mappings:
        raise Unsupported("a variant whose selector is not an enumeration")
    names = {option, option.lstrip("_"), "_" + option}
    return [(lo, hi) for label, lo, hi in sel_fc.mappings if label in names]


def align_of(fc: Any) -> int:
    if isinstance(fc, Int | Float):
        return max(fc.align, 8 if isinstance(fc, Int) and fc.varlen else 1)
    if isinstance(fc, String | Blob):
        return 8
    if isinstance(fc, Struct):
        return max([fc.align, 1, *(align_of(f) for _, f in fc.fields)])
    if isinstance(fc, Array):
        return max(fc.align, align_of(fc.element))
    return 1


def ref_names(*roots: Any) -> set[str]:
    """The last path element of every length/selector reference under these field classes."""
    out: set[str] = set()
    seen: set[int] = set()

    def walk(fc: Any) -> None:
        if fc is None or id(fc) in seen:
            return
        seen.add(id(fc))
        for attr in ("length", "selector"):
            r = getattr(fc, attr, None)
            if isinstance(r, Ref) and r.path:
                out.add(r.path[-1])
        if isinstance(fc, Struct):
            for _, f in fc.fields:
                walk(f)
        elif isinstance(fc, Variant):
            for _, f, _ in fc.options:
                walk(f)
        elif isinstance(fc, Array | Optional):
            walk(fc.element)

    for r in roots:
        walk(r)
    return out


def exec_source(source: str, ns: dict[str, Any]) -> dict[str, Any]:
    glb = {**_NS, **ns}
    exec(compile(source, "<ctf-decoder>", "exec"), glb)  # noqa: S102 - code generated above, no input text
    return glb
