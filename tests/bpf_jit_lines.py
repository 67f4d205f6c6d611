#!/usr/bin/env python3
"""Where a loaded XDP program's time goes, by source line.

    tests/bpf_jit_lines.py PROG_NAME [TOP] < ADDRESSES

PROG_NAME is a loaded BPF program's name. ADDRESSES, on stdin, are the
instruction addresses of time samples (hexadecimal, one a line, as `perf
script -F ip` gives them). Prints each address's offset in the program (the
TOP most sampled, default all) with its share of the samples and the BPF
instruction and source line it was JIT-compiled from. In a profile sampled
by time, a load that waits for memory shows as the instruction after it,
usually in the same line.

The offsets are computed here, against the loaded program's own start:
perf can name a BPF program by a stale symbol (an earlier run's tag and
start, at the same addresses), which shifts the offsets it prints. Of the
programs with that name, the one whose image holds the most samples is
read.

The kernel hands over everything needed through the bpf(2) syscall
(BPF_OBJ_GET_INFO_BY_FD: each function's address, the line info and the JIT
address of each line; BTF for the lines' text), so this needs no bpftool
built with libbfd and no /proc/kcore. Used by tests/fast-path-profile.sh
(docs/benchmarks.md, "Where the fast path's time goes"). Needs root
(CAP_SYS_ADMIN) to open programs by id.
"""

import ctypes
import errno
import os
import struct
import sys

SYS_BPF = 321  # x86_64
BPF_PROG_GET_NEXT_ID = 11
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_BTF_GET_FD_BY_ID = 19

# struct bpf_prog_info field offsets (include/uapi/linux/bpf.h).
PI_NAME = 64
PI_NR_JITED_KSYMS = 104
PI_NR_JITED_FUNC_LENS = 108
PI_JITED_KSYMS = 112
PI_JITED_FUNC_LENS = 120
PI_BTF_ID = 128
PI_NR_LINE_INFO = 148
PI_LINE_INFO = 152
PI_JITED_LINE_INFO = 160
PI_NR_JITED_LINE_INFO = 168
PI_LINE_INFO_REC_SIZE = 172
PI_JITED_LINE_INFO_REC_SIZE = 176
PROG_INFO_SIZE = 256

libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(bytes(attr), 128)
    r = libc.syscall(SYS_BPF, cmd, buf, 128)
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf(cmd {cmd})")
    return r, buf.raw


def obj_info(fd, size, request=b""):
    out = ctypes.create_string_buffer(bytes(request).ljust(size, b"\0"), size)
    bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, size, ctypes.addressof(out)))
    return out.raw


def programs_named(name):
    """The fds of the loaded programs named `name` (the kernel keeps 15
    characters of it)."""
    found = []
    pid = 0
    while True:
        try:
            _, raw = bpf(BPF_PROG_GET_NEXT_ID, struct.pack("<I", pid))
        except OSError as e:
            if e.errno == errno.ENOENT:  # past the last program
                return found
            raise
        pid = struct.unpack_from("<I", raw, 4)[0]
        try:
            fd, _ = bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("<I", pid))
        except OSError as e:
            if e.errno == errno.ENOENT:  # unloaded meanwhile
                continue
            raise
        info = obj_info(fd, PROG_INFO_SIZE)
        pname = info[PI_NAME : PI_NAME + 16].split(b"\0")[0].decode()
        if pname and name.startswith(pname):
            found.append(fd)
        else:
            os.close(fd)


def btf_strings(btf_id):
    """The string section of BTF object `btf_id`."""
    fd, _ = bpf(BPF_BTF_GET_FD_BY_ID, struct.pack("<I", btf_id))
    size = 1 << 24
    blob = ctypes.create_string_buffer(size)
    # struct bpf_btf_info: btf (u64 pointer), btf_size (u32), id (u32).
    try:
        info = obj_info(fd, 16, struct.pack("<QI", ctypes.addressof(blob), size))
    finally:
        os.close(fd)
    used = struct.unpack_from("<I", info, 8)[0]
    raw = blob.raw[:used]
    hdr_len, _, _, str_off, str_len = struct.unpack_from("<IIIII", raw, 4)
    return raw[hdr_len + str_off : hdr_len + str_off + str_len]


def cstr(strings, off):
    end = strings.find(b"\0", off)
    return strings[off:end].decode(errors="replace")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: tests/bpf_jit_lines.py PROG_NAME [TOP] < ADDRESSES")
    top = int(sys.argv[2]) if len(sys.argv) == 3 else None
    ips = [int(row.split()[0], 16) for row in sys.stdin if row.strip()]
    best = None  # (samples inside, start, table)
    for fd in programs_named(sys.argv[1]):
        try:
            start, length, table = read_program(fd)
        finally:
            os.close(fd)
        inside = sum(1 for ip in ips if start <= ip < start + length)
        if best is None or inside > best[0]:
            best = (inside, start, table)
    if best is None or best[0] == 0:
        sys.exit(f"bpf_jit_lines: no loaded program {sys.argv[1]} holds the samples")
    _, start, table = best
    counts = {}
    for ip in ips:
        counts[ip - start] = counts.get(ip - start, 0) + 1
    total = len(ips)
    for off, count in sorted(counts.items(), key=lambda c: -c[1])[:top]:
        line = max((t for t in table if t[0] <= off), default=None)
        where = f"insn {line[1]}, {line[2].rsplit('/', 1)[-1]}:{line[3]}: {line[4]}" if line else "?"
        print(f"{100 * count / total:5.1f}%  +{off:#06x}  {where}")


def read_program(fd):
    """The main function's start and length, and its lines: (JIT offset,
    BPF instruction, file, line, text), by offset."""
    info = obj_info(fd, PROG_INFO_SIZE)
    nksyms, nlens = struct.unpack_from("<II", info, PI_NR_JITED_KSYMS)
    btf_id = struct.unpack_from("<I", info, PI_BTF_ID)[0]
    nlines = struct.unpack_from("<I", info, PI_NR_LINE_INFO)[0]
    njlines, line_rec, jline_rec = struct.unpack_from("<III", info, PI_NR_JITED_LINE_INFO)

    ksyms = (ctypes.c_uint64 * nksyms)()
    lens = (ctypes.c_uint32 * nlens)()
    lines = ctypes.create_string_buffer(nlines * line_rec)
    jlines = ctypes.create_string_buffer(njlines * jline_rec)
    req = bytearray(PROG_INFO_SIZE)
    struct.pack_into("<II", req, PI_NR_JITED_KSYMS, nksyms, nlens)
    struct.pack_into("<Q", req, PI_JITED_KSYMS, ctypes.addressof(ksyms))
    struct.pack_into("<Q", req, PI_JITED_FUNC_LENS, ctypes.addressof(lens))
    struct.pack_into("<I", req, PI_NR_LINE_INFO, nlines)
    struct.pack_into("<Q", req, PI_LINE_INFO, ctypes.addressof(lines))
    struct.pack_into("<Q", req, PI_JITED_LINE_INFO, ctypes.addressof(jlines))
    struct.pack_into("<III", req, PI_NR_JITED_LINE_INFO, njlines, line_rec, jline_rec)
    obj_info(fd, PROG_INFO_SIZE, req)

    # The main function is the first in the image and the first ksym.
    base, main_len = ksyms[0], lens[0]
    strings = btf_strings(btf_id) if btf_id else b""
    table = []  # (JIT offset in the main function, insn, file, line, text)
    for k in range(min(nlines, njlines)):
        insn, file_off, line_off, line_col = struct.unpack_from("<IIII", lines.raw, k * line_rec)
        at = struct.unpack_from("<Q", jlines.raw, k * jline_rec)[0] - base
        if 0 <= at < main_len:
            table.append((at, insn, cstr(strings, file_off), line_col >> 10, cstr(strings, line_off).strip()))
    table.sort()
    return base, main_len, table


if __name__ == "__main__":
    main()
