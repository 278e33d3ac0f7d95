"""Split virtqueues (``sandbox/fuse/virtqueue.py``) over a memfd, rings built by hand here
(a test-side driver writing the virtio layouts with ``int.to_bytes``), no QEMU: chains
come out as the driver put them in, indirect tables, event index, and hostile rings
(loops, bad addresses, bad indices, oversize chains) are errors of one chain or of the
ring — never a crash, never a view outside guest memory.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.fuse import abi, vhost
from sandbox.fuse.virtqueue import INDIRECT_DESCS_MAX, BadAddress, BadChain, BrokenRing, Chain, GuestMemory, Virtqueue
from sandbox.vm.qemu import VIRTIOFS_QUEUE_SIZE
from sandbox_sim.budget import scale

MEM_BYTES = 1 << 20
GPA, UVA, OFFSET = 0x4000_0000, 0x7F00_0000_0000, 0x2000  # a region mapped at a nonzero file offset
DESC_AT, AVAIL_AT, USED_AT, DATA_AT = 0x0, 0x4000, 0x5000, 0x10000


def le(n: int, w: int) -> bytes:
    return n.to_bytes(w, "little")


class Driver:
    """The guest side: a memfd shared with the device's GuestMemory, rings written by hand."""

    def __init__(self, size: int = 16, *, event_idx: bool = False, indirect: bool = True, mem_bytes: int = MEM_BYTES):
        assert 16 * size <= AVAIL_AT and AVAIL_AT + 6 + 2 * size <= USED_AT and USED_AT + 6 + 8 * size <= DATA_AT
        self.fd = os.memfd_create("guest")
        os.ftruncate(self.fd, OFFSET + mem_bytes)
        table = vhost.MemTable((vhost.MemRegion(GPA, mem_bytes, UVA, OFFSET),))
        self.mem = GuestMemory.map(table, [os.dup(self.fd)])
        self.size = size
        self.avail_idx = 0
        self.next_desc = 0
        self.data_at = DATA_AT
        self.q = Virtqueue(self.mem, size, UVA + DESC_AT, UVA + AVAIL_AT, UVA + USED_AT,
                           event_idx=event_idx, indirect=indirect)

    def close(self):
        self.q.close()
        self.mem.close()
        os.close(self.fd)

    def poke(self, off: int, data: bytes) -> None:
        os.pwrite(self.fd, data, OFFSET + off)

    def peek(self, off: int, n: int) -> bytes:
        return os.pread(self.fd, n, OFFSET + off)

    def buffer(self, data: bytes) -> int:
        """Guest-physical address of ``data`` placed in the data area."""
        at = self.data_at
        self.poke(at, data)
        self.data_at += max(len(data), 1)
        return GPA + at

    def desc(self, table_off: int, i: int, addr: int, length: int, flags: int, nxt: int) -> None:
        self.poke(table_off + 16 * i, le(addr, 8) + le(length, 4) + le(flags, 2) + le(nxt, 2))

    def offer(self, head: int) -> None:
        self.poke(AVAIL_AT + 4 + 2 * (self.avail_idx % self.size), le(head, 2))
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        self.poke(AVAIL_AT + 2, le(self.avail_idx, 2))

    def chain(self, readable: list[bytes], writable: list[int], *, indirect: bool = False) -> int:
        """Put a chain in the table (or in an indirect table); its head."""
        segs = [(self.buffer(b), len(b), 0) for b in readable] + [(self.buffer(b"\0" * n), n, 2) for n in writable]
        if indirect:
            table_gpa = self.buffer(b"\0" * 16 * len(segs))
            for j, (a, n, f) in enumerate(segs):
                self.desc(table_gpa - GPA, j, a, n, f | (1 if j + 1 < len(segs) else 0), j + 1)
            head = self.next_desc
            self.desc(DESC_AT, head, table_gpa, 16 * len(segs), 4, 0)
            self.next_desc += 1
            return head
        head = self.next_desc
        for j, (a, n, f) in enumerate(segs):
            i = self.next_desc
            self.desc(DESC_AT, i, a, n, f | (1 if j + 1 < len(segs) else 0), i + 1)
            self.next_desc += 1
        return head

    def used(self) -> list[tuple[int, int]]:
        idx = int.from_bytes(self.peek(USED_AT + 2, 2), "little")
        return [(int.from_bytes(self.peek(USED_AT + 4 + 8 * (k % self.size), 4), "little"),
                 int.from_bytes(self.peek(USED_AT + 8 + 8 * (k % self.size), 4), "little")) for k in range(idx)]


@pytest.fixture
def drv():
    d = Driver()
    yield d
    d.close()


def test_a_chain_comes_out_as_put_in_and_its_reply_lands_in_guest_memory(drv):
    head = drv.chain([b"hello ", b"world"], [4, 8])
    drv.offer(head)
    c = drv.q.pop()
    assert isinstance(c, Chain) and c.head == head
    assert c.gather(100) == b"hello world" and c.gather(5) is None
    assert [len(w) for w in c.writable] == [4, 8]
    assert (c.readable_bytes, c.writable_bytes) == (11, 12)  # counted by the walk
    assert c.scatter(b"0123456789") == 10
    with pytest.raises(ValueError):
        c.scatter(b"x" * 13)
    addr = int.from_bytes(drv.peek(DESC_AT + 16 * (head + 2), 8), "little") - GPA
    assert drv.peek(addr, 4) == b"0123"
    assert c.scatter(b"abcd") == 4 and drv.peek(addr, 4) == b"abcd"  # one part, one whole segment
    c.release()
    assert (c.readable, c.writable, c.readable_bytes, c.writable_bytes) == ([], [], 0, 0)
    drv.q.push(head, 10)
    assert drv.used() == [(head, 10)]
    assert drv.q.pop() is None


def test_parts_are_scattered_in_order_across_segment_boundaries(drv):
    sizes = [3, 0, 5, 16]
    head = drv.chain([b"r"], sizes)
    drv.offer(head)
    c = drv.q.pop()
    data = bytes(range(21))
    parts = (data[:2], memoryview(data)[2:11], bytearray(data[11:]))
    with pytest.raises(ValueError):
        c.scatter(*parts, b"wxyz")  # 25 bytes in a room of 24
    assert c.scatter(*parts) == 21
    got = b"".join(bytes(w) for w in c.writable)[:21]
    assert got == data
    c.release()


def test_indirect_tables(drv):
    head = drv.chain([b"abc"], [16], indirect=True)
    drv.offer(head)
    c = drv.q.pop()
    assert c.gather(10) == b"abc" and [len(w) for w in c.writable] == [16]


def test_an_indirect_table_may_be_longer_than_the_queue(drv):
    """Linux puts a large virtio-fs request (~124 pages + headers) in one indirect table of
    more entries than a 128-entry queue: up to INDIRECT_DESCS_MAX entries are accepted."""
    head = drv.chain([bytes([i]) for i in range(3 * drv.size)], [1] * drv.size, indirect=True)
    drv.offer(head)
    c = drv.q.pop()
    assert isinstance(c, Chain) and len(c.readable) == 3 * drv.size and len(c.writable) == drv.size
    assert c.gather(1000) == bytes(range(3 * drv.size))


@pytest.mark.parametrize("indirect", [False, True])
def test_a_ring_of_1024_carries_a_one_mebibyte_write_and_read(indirect):
    """The size sessions give the device (``sandbox.vm.qemu.VIRTIOFS_QUEUE_SIZE``): Linux then
    sends a 1 MiB WRITE as its two headers and 256 pages, a 1 MiB READ's reply as its header
    and 256 pages — in an indirect table, or (without indirect descriptors) as a chain of
    ring descriptors; both come out whole, and a chain of all 1024 entries too."""
    d = Driver(VIRTIOFS_QUEUE_SIZE, indirect=indirect, mem_bytes=4 << 20)
    try:
        header = bytes(range(80))
        pages = [bytes([k]) * abi.PAGE_SIZE for k in range(abi.MAX_PAGES)]
        head = d.chain([header, *pages], [16, 8], indirect=indirect)
        d.offer(head)
        c = d.q.pop()
        assert isinstance(c, Chain) and len(c.readable) == 1 + abi.MAX_PAGES and len(c.writable) == 2
        data = c.gather(abi.REQUEST_BYTES_MAX)
        assert len(data) == 80 + abi.MAX_WRITE_BYTES and data == header + b"".join(pages)
        c.release()
        head = d.chain([header], [16] + [abi.PAGE_SIZE] * abi.MAX_PAGES, indirect=indirect)
        d.offer(head)
        c = d.q.pop()
        payload = os.urandom(abi.MAX_WRITE_BYTES)
        assert c.scatter(b"h" * 16, payload) == 16 + abi.MAX_WRITE_BYTES
        assert b"".join(bytes(w) for w in c.writable[1:]) == payload
        c.release()
        d.next_desc = 0  # every entry of the table in one chain (the previous ones are done with)
        head = d.chain([b"x"] * (d.size - 1), [1], indirect=indirect)
        d.offer(head)
        c = d.q.pop()
        assert isinstance(c, Chain) and len(c.readable) + len(c.writable) == VIRTIOFS_QUEUE_SIZE
        c.release()
    finally:
        d.close()


def test_a_loop_inside_an_indirect_table_is_a_bad_chain(drv):
    ok = drv.buffer(b"x")
    t = drv.buffer(le(ok, 8) + le(1, 4) + le(1, 2) + le(1, 2) + le(ok, 8) + le(1, 4) + le(1, 2) + le(0, 2))
    drv.desc(DESC_AT, 0, t, 32, 4, 0)
    drv.next_desc = 1
    drv.offer(0)
    assert isinstance(drv.q.pop(), BadChain)


def test_indirect_not_negotiated_is_a_bad_chain():
    d = Driver(indirect=False)
    try:
        d.offer(d.chain([b"abc"], [], indirect=True))
        assert isinstance(d.q.pop(), BadChain)
    finally:
        d.close()


@pytest.mark.parametrize("case", ["loop", "self-loop", "next-out", "addr-out", "addr-straddles", "read-after-write",
                                  "nested-indirect", "indirect-next", "indirect-len",
                                  "indirect-not-first", "indirect-too-long"])
def test_hostile_chains_are_bad_chains_and_the_ring_goes_on(drv, case):
    ok = drv.buffer(b"x")
    if case == "loop":
        drv.desc(DESC_AT, 0, ok, 1, 1, 1)
        drv.desc(DESC_AT, 1, ok, 1, 1, 0)
    elif case == "self-loop":
        drv.desc(DESC_AT, 0, ok, 1, 1, 0)
    elif case == "next-out":
        drv.desc(DESC_AT, 0, ok, 1, 1, drv.size)
    elif case == "addr-out":
        drv.desc(DESC_AT, 0, GPA + MEM_BYTES, 1, 0, 0)
    elif case == "addr-straddles":
        drv.desc(DESC_AT, 0, GPA + MEM_BYTES - 4, 8, 0, 0)
    elif case == "read-after-write":
        drv.desc(DESC_AT, 0, ok, 1, 3, 1)
        drv.desc(DESC_AT, 1, ok, 1, 0, 0)
    elif case == "nested-indirect":
        t = drv.buffer(b"\0" * 16)
        drv.desc(t - GPA, 0, t, 16, 4, 0)
        drv.desc(DESC_AT, 0, t, 16, 4, 0)
    elif case == "indirect-next":
        t = drv.buffer(le(ok, 8) + le(1, 4) + le(0, 4))
        drv.desc(DESC_AT, 0, t, 16, 5, 1)
    elif case == "indirect-len":
        t = drv.buffer(b"\0" * 24)
        drv.desc(DESC_AT, 0, t, 24, 4, 0)
    elif case == "indirect-not-first":
        t = drv.buffer(le(ok, 8) + le(1, 4) + le(0, 4))
        drv.desc(DESC_AT, 0, ok, 1, 1, 1)
        drv.desc(DESC_AT, 1, t, 16, 4, 0)
    elif case == "indirect-too-long":
        t = drv.buffer(b"\0" * 16 * (INDIRECT_DESCS_MAX + 1))
        drv.desc(DESC_AT, 0, t, 16 * (INDIRECT_DESCS_MAX + 1), 4, 0)
    drv.next_desc = 2
    drv.offer(0)
    bad = drv.q.pop()
    assert isinstance(bad, BadChain) and bad.head == 0
    good = drv.chain([b"next"], [])
    drv.offer(good)
    assert drv.q.pop().gather(10) == b"next"


def test_bad_indices_break_the_ring(drv):
    drv.poke(AVAIL_AT + 2, le(drv.size + 1, 2))  # more entries than the ring holds
    with pytest.raises(BrokenRing):
        drv.q.pop()
    drv.poke(AVAIL_AT + 2, le(1, 2))
    drv.poke(AVAIL_AT + 4, le(drv.size, 2))  # a head outside the table
    with pytest.raises(BrokenRing):
        drv.q.pop()


def test_rings_outside_memory_cannot_start(drv):
    with pytest.raises(BrokenRing):
        Virtqueue(drv.mem, 16, UVA + MEM_BYTES - 8, UVA + AVAIL_AT, UVA + USED_AT)
    with pytest.raises(BrokenRing):
        Virtqueue(drv.mem, 12, UVA, UVA + AVAIL_AT, UVA + USED_AT)


def test_notification_without_event_idx_follows_no_interrupt(drv):
    drv.offer(drv.chain([b"a"], []))
    drv.q.push(drv.q.pop().head, 0)
    assert drv.q.should_notify() is True
    assert drv.q.should_notify() is False  # nothing new
    drv.poke(AVAIL_AT, le(1, 2))  # VRING_AVAIL_F_NO_INTERRUPT
    drv.offer(drv.chain([b"b"], []))
    drv.q.push(drv.q.pop().head, 0)
    assert drv.q.should_notify() is False


def test_event_idx_publishes_avail_event_and_honours_used_event():
    d = Driver(event_idx=True)
    try:
        for _ in range(3):
            d.offer(d.chain([b"a"], []))
        d.poke(AVAIL_AT + 4 + 2 * d.size, le(1, 2))  # used_event: notify once used idx passes 1
        heads = [d.q.pop().head for _ in range(3)]
        assert d.q.arm() is False  # drained: kick at the next entry
        assert int.from_bytes(d.peek(USED_AT + 4 + 8 * d.size, 2), "little") == 3  # avail_event
        d.q.push(heads[0], 0)  # used idx 0 -> 1: not past 1
        assert d.q.should_notify() is False
        d.q.push(heads[1], 0)  # 1 -> 2: passes used_event 1
        assert d.q.should_notify() is True
        d.q.push(heads[2], 0)  # 2 -> 3: used_event still 1, already signalled past it
        assert d.q.should_notify() is False
    finally:
        d.close()


def avail_event(d) -> int:
    return int.from_bytes(d.peek(USED_AT + 4 + 8 * d.size, 2), "little")


def driver_kicks(d, old: int) -> bool:
    """The driver's rule (virtio 2.7.10 with the event index): after moving the available
    index from ``old`` to its current value, kick iff avail_event lies in [old, new)."""
    new, event = d.avail_idx, avail_event(d)
    return (new - event - 1) & 0xFFFF < (new - old) & 0xFFFF


def test_with_event_idx_kicks_stay_off_while_draining_and_arm_asks_for_the_next():
    d = Driver(event_idx=True)
    try:
        assert d.q.arm() is False and avail_event(d) == 0
        d.offer(d.chain([b"a"], []))
        assert driver_kicks(d, 0)  # idle: the first entry kicks
        d.q.suppress_kicks()
        d.q.pop()
        d.offer(d.chain([b"b"], []))  # added while the device drains: no kick ...
        assert not driver_kicks(d, 1)
        assert d.q.arm() is True  # ... and arming finds it waiting
        assert d.q.pop().gather(4) == b"b"
        assert d.q.arm() is False and avail_event(d) == 2
        d.offer(d.chain([b"c"], []))
        assert driver_kicks(d, 2)
        d.q.pop()
        assert d.q.arm(ahead=3) is False and avail_event(d) == 6  # a batch: the 4th entry from now kicks
        kicked = []
        for _ in range(4):
            old = d.avail_idx
            d.offer(d.chain([b"x"], []))
            kicked.append(driver_kicks(d, old))
        assert kicked == [False, False, False, True]
    finally:
        d.close()


def test_without_event_idx_draining_sets_no_notify_and_arm_clears_it(drv):
    drv.q.suppress_kicks()
    assert drv.peek(USED_AT, 2) == le(1, 2)  # VRING_USED_F_NO_NOTIFY
    drv.offer(drv.chain([b"a"], []))
    assert drv.q.arm() is True and drv.peek(USED_AT, 2) == le(0, 2)
    drv.q.pop()
    assert drv.q.arm() is False


def test_indices_wrap_at_65536():
    d = Driver(size=4)
    try:
        d.q.last_avail = d.avail_idx = 0xFFFE
        d.poke(AVAIL_AT + 2, le(d.avail_idx, 2))
        for _ in range(3):
            d.next_desc = 0
            d.offer(d.chain([b"w"], []))
            c = d.q.pop()
            assert c.gather(4) == b"w"
        assert d.q.last_avail == 1
    finally:
        d.close()


@settings(max_examples=scale(150, 3000), deadline=None)
@given(st.binary(min_size=16 * 16, max_size=16 * 16), st.lists(st.integers(0, 0xFFFF), max_size=20),
       st.integers(0, 0xFFFF), st.booleans())
def test_fuzz_random_rings_never_crash_nor_escape_memory(table, heads, avail_idx, indirect):
    """Random descriptor tables and available rings (addresses drawn near guest memory so
    some are valid): pop raises nothing but BrokenRing; chains' views are inside the region."""
    d = Driver(indirect=indirect)
    try:
        raw = bytearray(table)
        for i in range(16):  # bias addresses into (and just around) the region
            a = int.from_bytes(raw[16 * i:16 * i + 8], "little") % (MEM_BYTES + 0x1000) + GPA - 0x800
            raw[16 * i:16 * i + 8] = le(a, 8)
            raw[16 * i + 8:16 * i + 12] = le(int.from_bytes(raw[16 * i + 8:16 * i + 12], "little") % 0x2000, 4)
        d.poke(DESC_AT, bytes(raw))
        for k, h in enumerate(heads):
            d.poke(AVAIL_AT + 4 + 2 * (k % d.size), le(h % 20, 2))
        d.poke(AVAIL_AT + 2, le(avail_idx if avail_idx % 3 == 0 else len(heads), 2))
        for _ in range(len(heads) + 1):
            try:
                c = d.q.pop()
            except BrokenRing:
                break
            if c is None:
                break
            if isinstance(c, Chain):
                assert len(c.readable) + len(c.writable) <= max(d.size, INDIRECT_DESCS_MAX)
                assert c.readable_bytes + c.writable_bytes <= max(d.size, INDIRECT_DESCS_MAX) * 0x2000
                assert c.readable_bytes == sum(map(len, c.readable)) and c.writable_bytes == sum(map(len, c.writable))
                c.release()
            d.q.push(c.head, 0)
    finally:
        d.close()


def test_two_regions_translate_apart_and_a_range_across_them_is_refused():
    """QEMU splits RAM above 3 GiB into a second region (another offset of the same memfd)."""
    fd = os.memfd_create("ram")
    os.ftruncate(fd, 2 * MEM_BYTES)
    lo = vhost.MemRegion(0, MEM_BYTES, UVA, 0)
    hi = vhost.MemRegion(1 << 32, MEM_BYTES, UVA + MEM_BYTES, MEM_BYTES)
    mem = GuestMemory.map(vhost.MemTable((lo, hi)), [os.dup(fd), os.dup(fd)])
    try:
        os.pwrite(fd, b"low", 16)
        os.pwrite(fd, b"high", MEM_BYTES + 32)
        assert bytes(mem.gpa(16, 3)) == b"low" and bytes(mem.gpa((1 << 32) + 32, 4)) == b"high"
        assert bytes(mem.uva(UVA + MEM_BYTES + 32, 4)) == b"high"
        with pytest.raises(BadAddress):
            mem.gpa(MEM_BYTES - 2, 4)  # past the low region's end (the high one is elsewhere)
        with pytest.raises(BadAddress):
            mem.uva(UVA + MEM_BYTES - 2, 4)  # contiguous in QEMU's space, but two regions
    finally:
        mem.close()
        os.close(fd)
