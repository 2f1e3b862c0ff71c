# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The CTF reader's compiled core, ahead of time: tracesynth.io.ctf.fast's numba kernels (`_read_int`,
`_leb`, `_data`, `_run`, `intern`, `first_seen`, `carry`) in Cython, with the same signatures, statuses and
columns. Built with the package (setup.py, optional: without a compiler numba or Python reads).

Bounds: every byte read is checked against `lim` as the numba kernels check it (lim is within the
mapped file: the caller checks each packet's size); indices into the program, the registers and
the columns come from tracesynth.io.ctf.fast.compile_program and the caller's buffers (n < cap).
Integer arithmetic wraps as numba's does (-fwrapv, and unsigned arithmetic where it matters).
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

import numpy as np

# the instruction set and statuses of tracesynth.io.ctf.fast (checked there against these)
cdef enum:
    END, ALIGN, SKIP, INT, LEB, CSTR, BYTES, SKIPN, JIN, JMP, FAIL, CLOCK, SETID, OUT, OUTS, LOOP, NEXT
cdef enum:
    OK, FULL, BAD

ABI = 3  # fast.py refuses a build of another ABI (a stale extension beside newer sources)
OPCODES = (END, ALIGN, SKIP, INT, LEB, CSTR, BYTES, SKIPN, JIN, JMP, FAIL, CLOCK, SETID, OUT, OUTS, LOOP, NEXT)
STATUSES = (OK, FULL, BAD)


cdef inline bint _read_int(const uint8_t* buf, int64_t lim, int64_t q, int64_t sh, int64_t size, int64_t flags,
                           int64_t* out) noexcept nogil:
    """An integer of `size` bits at byte q, bit sh (CTF bit order) into *out; False where it does
    not fit below lim."""
    cdef int64_t nb = (sh + size + 7) >> 3
    cdef int64_t i, s
    cdef uint64_t v = 0, b, mask
    if q < 0 or q + nb > lim:
        return False
    if flags & 2:  # little-endian: the LSB first
        for i in range(nb):
            b = buf[q + i]
            s = 8 * i - sh
            if s >= 0:
                if s < 64:
                    v |= b << s
            else:
                v |= b >> (-s)
    else:
        if nb > 8:
            return False
        for i in range(nb):
            v = (v << 8) | buf[q + i]
        v >>= nb * 8 - sh - size
    if size < 64:
        mask = ((<uint64_t>1) << size) - 1
        v &= mask
        if flags & 1 and (v >> (size - 1)) & 1:
            v |= ~mask
    out[0] = <int64_t>v
    return True


cdef inline int64_t _leb(const uint8_t* buf, int64_t lim, int64_t q, int64_t signed, int64_t* out) noexcept nogil:
    """A LEB128 integer at byte q into *out; the next byte, or -1 where it does not decode."""
    cdef uint64_t v = 0, b
    cdef int64_t shift = 0
    while True:
        if q >= lim:
            return -1
        b = buf[q]
        q += 1
        if shift < 64:
            v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
        if shift > 70:
            return -1
    if signed and shift < 64 and (v >> (shift - 1)) & 1:
        v |= ~(((<uint64_t>1) << shift) - 1)
    out[0] = <int64_t>v
    return q


cdef inline int64_t _data(const uint8_t* buf, int64_t base, int64_t lim, int64_t p, int64_t op, int64_t a,
                          int64_t b, int64_t c, int64_t d, int64_t* regs) noexcept nogil:
    """The position after one data instruction (align, skip, read), or -1 where the bytes do not
    decode here (the Python decoder then redoes the packet)."""
    cdef int64_t q, e, m, v = 0
    if op == ALIGN:
        return (p + a - 1) & -a if a > 1 else p
    if op == SKIP:
        return p + a
    if op == INT:
        if not _read_int(buf, lim, base + (p >> 3), p & 7, a, b, &v):
            return -1
        regs[c] = v
        return p + a
    if p & 7 and op != SKIPN:  # LEB, CSTR, BYTES start on a byte
        return -1
    q = base + (p >> 3)
    if op == LEB:
        q = _leb(buf, lim, q, b, &v)
        if q < 0:
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
            regs[c] = q
            regs[c + 1] = e - q
        return (e + 1 - base) << 3
    if a >= 0:
        m = regs[a]
    else:
        m = b if op == BYTES else c
    if m < 0:
        return -1
    if op == SKIPN:
        return <int64_t>(<uint64_t>p + <uint64_t>b * <uint64_t>m)
    if m > lim - q:  # BYTES
        return -1
    if c >= 0:
        e = q
        if d:  # text: up to the first NUL
            while e < q + m and buf[e] != 0:
                e += 1
        else:
            e = q + m
        regs[c] = q
        regs[c + 1] = e - q
    return p + 8 * m


cdef int64_t _run(const uint8_t* buf, int64_t base, int64_t lim, int64_t* pp, int64_t end, uint64_t* pclk,
                  int64_t* pn, int64_t cap, const int64_t* code, const int64_t* evstart, int64_t nev,
                  int64_t default_id, int64_t* regs, uint64_t* ts, int64_t* ids, int64_t* vals, int64_t* lens,
                  uint8_t* valid, int64_t stride) noexcept nogil:
    """The numba `_run`'s loop; code is (n, 5) row-major, vals/lens/valid (ncols, stride)."""
    cdef int64_t p = pp[0], n = pn[0], p0, eid, pc, op, a, b, c, d, m
    cdef const int64_t* ins
    cdef uint64_t clk = pclk[0], v, mask
    cdef bint in_event
    cdef int64_t status = OK
    while p < end:
        if n >= cap:
            status = FULL
            break
        p0 = p
        eid = default_id
        pc = 0
        in_event = False
        while True:
            ins = code + 5 * pc
            op = ins[0]
            a = ins[1]
            b = ins[2]
            c = ins[3]
            d = ins[4]
            if op == END:
                if in_event:
                    break
                if eid < 0 or eid >= nev or evstart[eid] < 0:
                    status = BAD
                    break
                pc = evstart[eid]
                in_event = True
                continue
            if op <= SKIPN:
                p = _data(buf, base, lim, p, op, a, b, c, d, regs)
                if p < 0:
                    p = p0
                    status = BAD
                    break
            elif op == JIN:
                if b <= regs[a] <= c:
                    pc = d
                    continue
            elif op == JMP:
                pc = d
                continue
            elif op == FAIL:
                status = BAD
                break
            elif op == CLOCK:
                v = <uint64_t>regs[a]
                if c or b >= 64:  # the compiler gives every 64-bit clock c=1
                    clk = v
                else:
                    mask = ((<uint64_t>1) << b) - 1
                    if v < (clk & mask):
                        clk += mask + 1
                    clk = (clk & ~mask) | v
            elif op == SETID:
                eid = regs[a]
            elif op == OUT or op == OUTS:
                vals[b * stride + n] = regs[a]
                valid[b * stride + n] = 1
                if op == OUTS:
                    lens[b * stride + n] = regs[a + 1]
            elif op == LOOP:
                m = regs[a] if a >= 0 else b
                if m > ((lim - base) << 3) - p + 1:
                    status = BAD
                    break
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
        if status != OK:
            break
        if p <= p0:
            status = BAD
            break
        ts[n] = clk
        ids[n] = eid
        n += 1
    if status == OK and p > end:
        status = BAD
    pp[0] = p
    pclk[0] = clk
    pn[0] = n
    return status


def run(const uint8_t[::1] buf, int64_t base, int64_t lim, int64_t p, int64_t end, uint64_t clk, int64_t n,
        int64_t cap, const int64_t[:, ::1] code, const int64_t[::1] evstart, int64_t default_id,
        int64_t[::1] regs, uint64_t[::1] ts, int64_t[::1] ids, int64_t[:, ::1] vals, int64_t[:, ::1] lens,
        uint8_t[:, ::1] valid):
    """Decode the events of one packet (bytes base..lim of buf; p and end in bits from base) into
    rows n.. of the columns; returns (status, p, clk, n) to resume at."""
    cdef int64_t status
    cdef Py_ssize_t stride = vals.shape[1]
    cdef const uint8_t* data = NULL
    if code.shape[1] != 5 or regs.shape[0] < 1:
        raise ValueError("a program is (n, 5) instructions, with at least one register")
    if lim > buf.shape[0]:
        raise ValueError("lim is past the end of the buffer")
    if lens.shape[1] != stride or valid.shape[1] != stride or lens.shape[0] < vals.shape[0] or valid.shape[0] < vals.shape[0]:
        raise ValueError("vals, lens and valid differ in shape")
    if cap > ts.shape[0] or cap > ids.shape[0] or cap > stride:
        raise ValueError("cap is larger than the columns")
    if buf.shape[0]:
        data = &buf[0]
    with nogil:
        status = _run(data, base, lim, &p, end, &clk, &n, cap, &code[0, 0], &evstart[0], evstart.shape[0],
                      default_id, &regs[0], &ts[0], &ids[0], &vals[0, 0], &lens[0, 0], &valid[0, 0], stride)
    return status, p, np.uint64(clk), n


def intern(const uint8_t[::1] buf, const int64_t[:] offs, const int64_t[:] lens, const uint8_t[:] valid):
    """Codes (first-seen order, -1 where not valid) of the byte strings buf[off:off+len], and the
    (offset, length) of each distinct one."""
    cdef Py_ssize_t n = offs.shape[0], size = 64, i, slot, nvalid = 0
    cdef int64_t o, m, j, c, f, k = 0
    cdef uint64_t h
    cdef bint same
    for i in range(n):  # the table for the strings there are (a column is mostly empty rows)
        if valid[i]:
            nvalid += 1
    while size < 2 * nvalid:
        size *= 2
    table_a = np.full(size, -1, dtype=np.int64)
    codes_a = np.full(n, -1, dtype=np.int32)
    first_a = np.zeros(nvalid, dtype=np.int64)
    cdef int64_t[::1] table = table_a
    cdef int32_t[::1] codes = codes_a
    cdef int64_t[::1] first = first_a
    with nogil:
        for i in range(n):
            if not valid[i]:
                continue
            o = offs[i]
            m = lens[i]
            h = 14695981039346656037ULL
            for j in range(m):
                h = (h ^ buf[o + j]) * 1099511628211ULL
            slot = <Py_ssize_t>(h & <uint64_t>(size - 1))
            while True:
                c = table[slot]
                if c < 0:
                    table[slot] = k
                    first[k] = i
                    codes[i] = <int32_t>k
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
                        codes[i] = <int32_t>c
                        break
                slot = (slot + 1) & (size - 1)
    return codes_a, first_a[:k]


def first_seen(const int32_t[:] codes, int64_t k):
    """Codes renumbered in order of first appearance (-1 kept), and the old code of each new one."""
    cdef Py_ssize_t n = codes.shape[0], i
    cdef int32_t c
    cdef int64_t m = 0
    remap_a = np.full(k, -1, dtype=np.int32)
    order_a = np.zeros(k, dtype=np.int64)
    out_a = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] remap = remap_a
    cdef int64_t[::1] order = order_a
    cdef int32_t[::1] out = out_a
    with nogil:
        for i in range(n):
            c = codes[i]
            if c < 0:
                out[i] = -1
                continue
            if remap[c] < 0:
                remap[c] = <int32_t>m
                order[m] = c
                m += 1
            out[i] = remap[c]
    return out_a, order_a[:m]


def carry(const int64_t[::1] key, const uint8_t[::1] mark, const int64_t[::1] at, const int32_t[::1] at2,
          const int64_t[::1] after, const int32_t[::1] after2, int64_t[::1] state, int32_t[::1] state2,
          int64_t[::1] out, int32_t[::1] out2):
    """Per key (a CPU; -1 for none) the pair (value, value2) set by its latest marked row, carried
    from `state`/`state2` (indexed by key, updated in place): the j-th marked row (a sched_switch)
    gets `at[j]`/`at2[j]` (the task switching out) and sets its key's state to `after[j]`/`after2[j]`
    (the task switching in); any other row gets its key's state; a row without a key gets -1."""
    cdef Py_ssize_t n = key.shape[0], i, j = 0, marks = 0
    cdef int64_t k, top = -1
    if not (mark.shape[0] == out.shape[0] == out2.shape[0] == n):
        raise ValueError("carry's row arrays differ in length")
    with nogil:  # the keys index the state and the marks the per-mark values: checked first
        for i in range(n):
            if key[i] > top:
                top = key[i]
            if mark[i]:
                marks += 1
    if top >= state.shape[0] or top >= state2.shape[0]:
        raise ValueError("a key past the end of the state")
    if not (at.shape[0] == at2.shape[0] == after.shape[0] == after2.shape[0] == marks):
        raise ValueError("carry needs one value of each per marked row")
    with nogil:
        for i in range(n):
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
