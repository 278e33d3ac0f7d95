#!/usr/bin/env python3
"""How the kernel holds a file in its page cache: the share of its pages in large folios.

Run ``python bench/page_cache_folios.py FILE...`` as root. For each file it maps the whole
file shared and read-only with ``MAP_POPULATE`` (pages already cached are mapped as they
are; missing ones are read first, so run it on files that are cached), then looks each
mapped page up in ``/proc/self/pagemap`` (its frame) and ``/proc/kpageflags`` (its flags)
and prints how many pages are the head or a tail of a compound page — a large folio —
and how many are small (4 KiB) folios. Asserts nothing; changes nothing.

Why: copying from the page cache costs per folio. On the development machine's kernel
(Linux 6.18) ext4 caches a file written in 1 MiB writes in large folios, while a FUSE
mount's page cache is all 4 KiB folios — whether filled by the mount's writes or by
readahead — so a warm read of the same bytes copies 256 times as many folios through the
mount (docs/fuse.md, "Benchmark": the warm sequential read). ``bench/fuse_local.py
--folios`` prints this after its ``read-seq`` phase on every side.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys

PAGE = mmap.PAGESIZE
#: /proc/kpageflags bits (include/uapi/linux/kernel-page-flags.h)
KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 15, 16
PM_PRESENT = 1 << 63
PM_PFN_MASK = (1 << 55) - 1
#: pagemap/kpageflags entries read per call
BATCH_PAGES = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def available() -> str | None:
    """None if this process can read page frames and their flags, else why not."""
    if os.geteuid() != 0:
        return "needs root (/proc/self/pagemap shows page frames, and /proc/kpageflags opens, only for root)"
    if not os.access("/proc/kpageflags", os.R_OK):
        return "/proc/kpageflags is missing (a kernel without CONFIG_PROC_PAGE_MONITOR)"
    return None


def folios(path: str) -> dict[str, int]:
    """``pages`` of ``path``; of them ``large`` (in compound pages), ``small`` and ``absent``
    (not mapped after populating: a hole past the end, or a failed read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pages = (size + PAGE - 1) // PAGE
        out = {"pages": pages, "large": 0, "small": 0, "absent": 0}
        if not pages:
            return out
        addr = _libc.mmap(None, pages * PAGE, mmap.PROT_READ, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0)
        if addr in (None, _MAP_FAILED):
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        try:
            with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as kflags:
                for first in range(0, pages, BATCH_PAGES):
                    n = min(BATCH_PAGES, pages - first)
                    entries = struct.unpack(f"{n}Q", os.pread(pagemap.fileno(), n * 8, (addr // PAGE + first) * 8))
                    for e in entries:
                        if not e & PM_PRESENT:
                            out["absent"] += 1
                            continue
                        flags, = struct.unpack("Q", os.pread(kflags.fileno(), 8, (e & PM_PFN_MASK) * 8))
                        compound = flags >> KPF_COMPOUND_HEAD & 1 or flags >> KPF_COMPOUND_TAIL & 1
                        out["large" if compound else "small"] += 1
        finally:
            _libc.munmap(addr, pages * PAGE)
        return out
    finally:
        os.close(fd)


def describe(counts: dict[str, int]) -> str:
    pages = counts["pages"] or 1
    return (f"{counts['pages']} pages: {counts['large'] * 100 / pages:.0f} % in large folios, "
            f"{counts['small'] * 100 / pages:.0f} % in 4 KiB folios"
            + (f", {counts['absent']} not mapped" if counts["absent"] else ""))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    why = available()
    if why:
        print(f"page_cache_folios: {why}", file=sys.stderr)
        return 1
    for path in args:
        print(f"{path}: {describe(folios(path))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
