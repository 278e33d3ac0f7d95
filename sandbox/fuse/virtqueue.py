"""Split virtqueues over the guest's memory (issue 17): descriptor chains in, used entries out.

:class:`GuestMemory` is the front-end's memory table (SET_MEM_TABLE): regions, each known
by its guest-physical address, its address in the front-end's (QEMU's) virtual address
space and a buffer (the mmap of its memfd). :meth:`GuestMemory.gpa` and
:meth:`GuestMemory.uva` translate a range to a ``memoryview`` of that buffer — no copy —
or raise :class:`BadAddress`.

:class:`Virtqueue` is one split ring (virtio 1.x, little-endian): the descriptor table
(16 bytes each: u64 addr, u32 len, u16 flags, u16 next), the available ring (u16 flags,
u16 idx, u16 ring[size], u16 used_event) and the used ring (u16 flags, u16 idx,
{u32 id, u32 len}[size], u16 avail_event). Ring addresses are front-end virtual addresses
(SET_VRING_ADDR); buffer addresses in descriptors are guest-physical.

Invariants (the guest is untrusted: its ring contents are data, never a crash):

* :meth:`Virtqueue.pop` returns the next :class:`Chain` — readable segments then writable
  ones, as memoryviews — or ``None`` when the ring is empty; a chain that cannot be walked
  (an address outside every region, a ``next`` past its table, a loop or a chain longer
  than its table — the queue size, or an indirect table's entries, at most
  :data:`INDIRECT_DESCS_MAX` —, a readable descriptor after a writable one, an indirect
  descriptor that is nested, chained or not the chain's only one, a malformed indirect
  table, indirect descriptors not negotiated) is a :class:`BadChain` with its head: the
  device returns it used with length 0 and goes on;
* an available index more than ``size`` ahead of the last one seen, or a head index
  outside the table, breaks the ring: :class:`BrokenRing` (the device stops the queue; the
  driver must reset it) — the server's state is untouched;
* :meth:`Virtqueue.push` writes the used element before the used index (the guest reads
  the index, then the element); :meth:`Virtqueue.should_notify` applies the driver's
  ``used_event`` with ``VIRTIO_RING_F_EVENT_IDX``, ``VRING_AVAIL_F_NO_INTERRUPT`` without it;
* kicks: while the device drains a ring it asks for none (:meth:`Virtqueue.suppress_kicks`:
  ``VRING_USED_F_NO_NOTIFY``, or with the event index ``avail_event`` simply left behind);
  :meth:`Virtqueue.arm` asks for the next one (``avail_event`` = the next entry, or a batch
  ahead) and then, after a full memory barrier, says whether entries came meanwhile — the
  driver may have looked before the request was published, so the device drains again
  rather than waiting for a kick that will not come.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass

DESC = struct.Struct("<QIHH")
DESC_F_NEXT, DESC_F_WRITE, DESC_F_INDIRECT = 1, 2, 4
AVAIL_F_NO_INTERRUPT = 1
USED_F_NO_NOTIFY = 1
#: the largest queue size (virtio: a power of two ≤ 32768)
QUEUE_SIZE_MAX = 32768
#: entries of one indirect table (QEMU's VIRTQUEUE_MAX_SIZE: Linux's largest virtio-fs
#: request, ~124 pages plus headers, needs more than a 128-entry queue holds)
INDIRECT_DESCS_MAX = 1024
_U16 = struct.Struct("<H")
_USED_ELEM = struct.Struct("<II")
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier between our store to the ring and our next load from it (taking
    a lock is a locked instruction on x86: stores before it are visible before loads after
    it). The server's periodic sweep of the rings covers a kick missed anyway."""
    with _FENCE:
        pass

# virtio feature bits used here
F_INDIRECT_DESC = 1 << 28
F_EVENT_IDX = 1 << 29
F_VERSION_1 = 1 << 32


class BadAddress(ValueError):
    """A guest range outside every mapped region (or across two of them)."""


class BrokenRing(ValueError):
    """The ring's indices are impossible: the queue cannot be served until it is reset."""


@dataclass
class Region:
    guest_addr: int
    size: int
    user_addr: int
    view: memoryview


class GuestMemory:
    """The regions of one memory table; translation with bounds checks (module docstring)."""

    def __init__(self, regions: list[Region], mappings: list[mmap.mmap] | None = None):
        self.regions = regions
        self._mappings = mappings or []
        #: (start, end, view) of each region by guest-physical address: the descriptor walk's table
        self.by_gpa = tuple((r.guest_addr, r.guest_addr + r.size, r.view) for r in regions)

    @classmethod
    def map(cls, table, fds: list[int]) -> GuestMemory:
        """mmap each region of ``table`` (a :class:`~.vhost.MemTable`) from its descriptor
        (shared, read-write) and close the descriptors. ``OSError``/``ValueError`` if one
        cannot be mapped — empty, or not inside its file (whatever its size or offset: a
        mapping past the file's end would fault when touched) — then nothing stays mapped."""
        regions, maps = [], []
        try:
            if len(fds) != len(table.regions):
                raise ValueError(f"{len(table.regions)} regions with {len(fds)} descriptors")
            for r, fd in zip(table.regions, fds):
                if r.size == 0:
                    raise ValueError("an empty region")
                file_bytes = os.fstat(fd).st_size
                if r.mmap_offset + r.size > file_bytes:  # also any size no mmap could take
                    raise ValueError(f"region {r.mmap_offset:#x}+{r.size:#x} beyond its file of {file_bytes:#x} bytes")
                mm = mmap.mmap(fd, r.mmap_offset + r.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                maps.append(mm)
                regions.append(Region(r.guest_addr, r.size, r.user_addr,
                                      memoryview(mm)[r.mmap_offset:r.mmap_offset + r.size]))
        except BaseException:
            for reg in regions:
                reg.view.release()
            for mm in maps:
                mm.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        return cls(regions, maps)

    def _find(self, addr: int, length: int, user: bool) -> memoryview:
        for r in self.regions:
            base = r.user_addr if user else r.guest_addr
            if base <= addr and addr + length <= base + r.size:
                return r.view[addr - base:addr - base + length]
        kind = "user" if user else "guest"
        raise BadAddress(f"{kind} range {addr:#x}+{length:#x} is not inside one mapped region")

    def gpa(self, addr: int, length: int) -> memoryview:
        return self._find(addr, length, user=False)

    def uva(self, addr: int, length: int) -> memoryview:
        return self._find(addr, length, user=True)

    def close(self) -> None:
        """Unmap. A chain still holding a view keeps its mapping alive until it is dropped."""
        self.by_gpa = ()
        for r in self.regions:
            r.view.release()
        for mm in self._mappings:
            try:
                mm.close()
            except BufferError:  # a view is still exported (a held chain): freed with it
                pass
        self.regions, self._mappings = [], []


class Chain:
    """One descriptor chain: ``readable`` then ``writable`` segments (memoryviews of guest
    memory) and their byte totals, counted by the walk (``readable_bytes``,
    ``writable_bytes``: read per request, so not summed again each time)."""

    __slots__ = ("head", "readable", "writable", "readable_bytes", "writable_bytes")

    def __init__(self, head: int, readable: list[memoryview] | None = None,
                 writable: list[memoryview] | None = None):
        self.head = head
        self.readable = readable if readable is not None else []
        self.writable = writable if writable is not None else []
        self.readable_bytes = sum(map(len, readable)) if readable else 0
        self.writable_bytes = sum(map(len, writable)) if writable else 0

    def gather(self, limit: int) -> bytes | None:
        """The readable bytes joined (one copy), or ``None`` if more than ``limit``."""
        if self.readable_bytes > limit:
            return None
        return b"".join(self.readable)

    def scatter(self, *parts) -> int:
        """Write ``parts`` (bytes-like, in order) across the writable segments, each byte
        copied once; the bytes written (all, or ``ValueError`` and nothing written)."""
        total = 0
        views = []
        for part in parts:
            mv = part if type(part) is memoryview else memoryview(part)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            views.append(mv)
            total += len(mv)
        if total > self.writable_bytes:
            raise ValueError(f"{total} bytes do not fit in {self.writable_bytes}")
        if not total:
            return 0
        segs = iter(self.writable)
        seg, off, room = None, 0, 0
        for mv in views:
            pos, n = 0, len(mv)
            while pos < n:
                if room == 0:
                    seg = next(segs)
                    off, room = 0, len(seg)
                    if room == 0:
                        continue
                k = room if room < n - pos else n - pos
                seg[off:off + k] = mv[pos:pos + k] if pos or k != n else mv
                pos += k
                off += k
                room -= k
        return total

    def release(self) -> None:
        for b in self.readable:
            b.release()
        for b in self.writable:
            b.release()
        self.readable, self.writable = [], []
        self.readable_bytes = self.writable_bytes = 0


@dataclass
class BadChain:
    head: int
    reason: str


class Virtqueue:
    """One split virtqueue (module docstring). ``last_avail`` is the next available-ring
    position to read (SET_VRING_BASE sets it; GET_VRING_BASE reports it)."""

    def __init__(self, mem: GuestMemory, size: int, desc: int, avail: int, used: int, *,
                 event_idx: bool = False, indirect: bool = False, last_avail: int = 0):
        if not (0 < size <= QUEUE_SIZE_MAX and size & (size - 1) == 0):
            raise BrokenRing(f"queue size {size} is not a power of two in 1..{QUEUE_SIZE_MAX}")
        self.mem = mem
        self.size = size
        self.event_idx = event_idx
        self.indirect = indirect
        try:
            self.desc = mem.uva(desc, 16 * size)
            self.avail = mem.uva(avail, 6 + 2 * size)
            self.used = mem.uva(used, 6 + 8 * size)
        except BadAddress as e:
            raise BrokenRing(f"ring not in guest memory: {e}") from None
        self.last_avail = last_avail & 0xFFFF
        self.used_idx = _U16.unpack_from(self.used, 2)[0]
        self._signalled_used = self.used_idx  # used idx at the last notification

    def avail_idx(self) -> int:
        return _U16.unpack_from(self.avail, 2)[0]

    def pending(self) -> int:
        n = (_U16.unpack_from(self.avail, 2)[0] - self.last_avail) & 0xFFFF
        if n > self.size:
            raise BrokenRing(f"available index {self.avail_idx()} is {n} ahead of {self.last_avail} "
                             f"(queue size {self.size})")
        return n

    def pop(self) -> Chain | BadChain | None:
        n = (_U16.unpack_from(self.avail, 2)[0] - self.last_avail) & 0xFFFF  # pending(), inlined
        if n == 0:
            return None
        if n > self.size:
            self.pending()  # raises BrokenRing, saying why
        head = _U16.unpack_from(self.avail, 4 + 2 * (self.last_avail % self.size))[0]
        if head >= self.size:
            raise BrokenRing(f"head {head} outside a table of {self.size}")
        self.last_avail = (self.last_avail + 1) & 0xFFFF
        try:
            return self._walk(head)
        except (BadAddress, _Bad) as e:
            return BadChain(head, str(e))

    def _walk(self, head: int) -> Chain:
        chain = Chain(head)
        readable, writable = chain.readable, chain.writable
        nread = nwrite = 0
        regions = self.mem.by_gpa  # the guest-physical translation of GuestMemory.gpa, inlined
        unpack = DESC.unpack_from
        table, limit, i, count, nested = self.desc, self.size, head, 0, False
        try:
            while True:
                count += 1
                if count > limit:  # each table's chain visits each of its entries at most once
                    raise _Bad(f"chain longer than its table of {limit} (a loop?)")
                addr, length, flags, nxt = unpack(table, 16 * i)
                if flags & DESC_F_INDIRECT:
                    if not self.indirect:
                        raise _Bad("indirect descriptor, not negotiated")
                    if nested:
                        raise _Bad("indirect descriptor inside an indirect table")
                    if flags & DESC_F_NEXT or readable or writable:
                        raise _Bad("an indirect descriptor must be the chain's only one")
                    if length == 0 or length % 16 or length // 16 > INDIRECT_DESCS_MAX:
                        raise _Bad(f"indirect table of {length} bytes")
                    table, limit, i, count, nested = self.mem.gpa(addr, length), length // 16, 0, 0, True
                    continue
                end = addr + length
                for start, stop, view in regions:
                    if start <= addr and end <= stop:
                        buf = view[addr - start:end - start]
                        break
                else:
                    raise BadAddress(f"guest range {addr:#x}+{length:#x} is not inside one mapped region")
                if flags & DESC_F_WRITE:
                    writable.append(buf)
                    nwrite += length
                elif writable:
                    buf.release()
                    raise _Bad("readable descriptor after a writable one")
                else:
                    readable.append(buf)
                    nread += length
                if not flags & DESC_F_NEXT:
                    chain.readable_bytes, chain.writable_bytes = nread, nwrite
                    return chain
                if nxt >= limit:
                    raise _Bad(f"next {nxt} outside a table of {limit}")
                i = nxt
        except BaseException:
            chain.release()
            raise

    def push(self, head: int, length: int) -> None:
        """Return chain ``head`` as used with ``length`` bytes written."""
        _USED_ELEM.pack_into(self.used, 4 + 8 * (self.used_idx % self.size), head, length)
        self.used_idx = (self.used_idx + 1) & 0xFFFF
        _U16.pack_into(self.used, 2, self.used_idx)

    def suppress_kicks(self) -> None:
        """While the device drains the ring the driver need not kick: ``VRING_USED_F_NO_NOTIFY``
        without the event index; with it, ``avail_event`` stays where the last :meth:`arm`
        put it, which the driver has passed."""
        if not self.event_idx:
            _U16.pack_into(self.used, 0, USED_F_NO_NOTIFY)

    def arm(self, ahead: int = 0) -> bool:
        """Ask for a kick when the driver makes available the entry ``ahead`` places past the
        next one to read (0: at the next entry; without the event index: at every entry);
        True if entries are waiting already (drain again: the driver may have decided
        before it saw this)."""
        if self.event_idx:
            _U16.pack_into(self.used, 4 + 8 * self.size, (self.last_avail + ahead) & 0xFFFF)
        else:
            _U16.pack_into(self.used, 0, 0)
        _fence()
        return self.pending() > 0

    def should_notify(self) -> bool:
        """Whether to signal the call eventfd now for the entries pushed since the last time."""
        old, new = self._signalled_used, self.used_idx
        if old == new:
            return False
        self._signalled_used = new
        if self.event_idx:
            used_event = _U16.unpack_from(self.avail, 4 + 2 * self.size)[0]
            return (new - used_event - 1) & 0xFFFF < (new - old) & 0xFFFF
        return not _U16.unpack_from(self.avail, 0)[0] & AVAIL_F_NO_INTERRUPT

    def close(self) -> None:
        for v in (self.desc, self.avail, self.used):
            v.release()


class _Bad(ValueError):
    pass
