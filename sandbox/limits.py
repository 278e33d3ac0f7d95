"""Every resource limit of the protocol servers, in one place.

A client of a protocol server (the 9P server today; the FUSE server, which serves the
same :class:`~sandbox.mounts.Provider` objects, shares these) is untrusted input: a guest
kernel, or a guest root process talking to the server's port directly. Nothing it sends
may make the host agent grow without bound or starve its other clients — or the undo
core, which runs in the same process. So every buffer, table and wait has a named limit
(units in the name) and a defined overflow behaviour:

================================================  ==========  ==========================================
limit (``ServerLimits`` field)                    default     when exceeded
================================================  ==========  ==========================================
``msize_bytes_max``                               1 MiB       a larger msize asked in Tversion is clamped
``connections_max``                               16          the connection is accepted and closed at once
                                                              (logged with the reason); others go on
``frame_bytes_before_version_max``                8 KiB       a larger frame before Tversion: connection
                                                              closed (framing is lost); after it, a frame
                                                              is bounded by the negotiated msize
``frame_incomplete_timeout_s``                    60 s        a frame not complete this long after its
                                                              first byte closes the connection (time
                                                              spent not reading it does not count; while
                                                              a safeguard hold is pending — the VM may be
                                                              paused — the deadline is extended)
``write_buffer_bytes_max``                        8 MiB       the connection's unsent replies are over it:
                                                              its requests are not read until they drain
``held_request_bytes_per_connection_max``         8 MiB       requests waiting behind a safeguard hold are
                                                              over it: requests are not read until it drops
``fids_per_connection_max``                       65,536      ``ENFILE``
``open_files_per_connection_max``                 1,024       ``EMFILE`` — and never more than
``open_files_per_connection_share_max``           1/4         this share of the process's budget
(process) open files of all connections           RLIMIT_NOFILE soft − ``DESCRIPTORS_RESERVED``
                                                              − the servers' connection sockets: ``ENFILE``
``xattr_bytes_per_connection_max``                1 MiB       xattr values held for Txattrwalk/Txattrcreate
                                                              fids: ``ENOMEM``
``dir_listing_bytes_per_connection_max``          16 MiB      readdir listings kept between Treaddirs: the
                                                              least recently used is dropped (re-read on
                                                              demand, offsets stay valid); a directory is
                                                              read only up to the whole budget
                                                              (``HostFS.listdir(limit_bytes=)``), one
                                                              over it is ``ENOMEM``
``held_requests_per_export_max``                  10,000      ``ENOSPC`` (:mod:`sandbox.serving.holds`)
``locks_per_export_max``                          100,000     ``ENOLCK`` (:mod:`sandbox.serving.locks`)
``xattr_value_bytes_max`` (the kernel's)          64 KiB      ``E2BIG``
================================================  ==========  ==========================================

Safeguard holds are per session, not per server (:class:`~sandbox.serving.holds.HoldBroker`):
at most ``HOLDS_PENDING_PER_SESSION_MAX`` holds pending at once (one more is denied at
once, logged — the core keeps at most one per working folder, so this only bounds a
broken caller) and ``HOLD_SUBSCRIBERS_MAX`` subscribers (one more: ``RuntimeError``). How
long a hold may wait is the safeguard's ``timeout_s`` (:class:`~sandbox.core.safeguard.SafeguardConfig`,
default 30 s); the broker enforces that one deadline.

Worst case per connection, all limits reached at once (measured by
``sandbox_sim/test_ninep_limits.py``): unsent replies up to twice ``write_buffer_bytes_max`` while
they drain (asyncio keeps them in one bytearray, copied when it grows), held requests,
one partial frame and the unhandled frames of one 256 KiB read, xattr values, listings:
≈ 16 + 8 + 1 + 0.25 + 1 + 16 MiB; plus ~0.2 KiB per fid (13 MiB at 65,536) and each
distinct path a fid names (≤ 4 KiB, one string however many fids share it). About 55 MiB,
times ``connections_max``.

**Descriptors** are a process-wide resource (``RLIMIT_NOFILE``): a server raises the soft
limit to the hard one when it starts (:func:`raise_nofile_soft_limit`); client-held file
handles of all servers in the process share one :class:`DescriptorBudget`, which keeps
``DESCRIPTORS_RESERVED`` descriptors (plus one per possible connection socket) free for
the undo core (WAL, preimages, rollback), the listening sockets, logs and child processes.

This module imports nothing of the project: the core, the mounts and every server can use it.
"""

from __future__ import annotations

import errno
import logging
import resource
import threading
from dataclasses import dataclass

log = logging.getLogger("sandbox.limits")

KiB = 1 << 10
MiB = 1 << 20

MSIZE_BYTES_MIN = 8192  # the smallest msize_bytes_max a server may be configured with
XATTR_VALUE_BYTES_MAX = 64 * KiB  # the kernel's XATTR_SIZE_MAX (and XATTR_LIST_MAX)
HELD_REQUESTS_PER_EXPORT_MAX = 10_000
LOCKS_PER_EXPORT_MAX = 100_000
HOLDS_PENDING_PER_SESSION_MAX = 64  # safeguard holds waiting for an answer, all folders of a session
HOLD_SUBSCRIBERS_MAX = 32  # servers, STDIO, SDK, MCP, the VM pause hook, decide callbacks
# -- share-server control channel (issue 13): agent <-> confined file-server process
#: one JSON line on the channel; a longer one closes the channel (framing is lost; the peer is ours: a bug)
CONTROL_LINE_BYTES_MAX = 1 * MiB
#: requests one side runs at once for the other; one more is answered ``channel.busy`` at once
CONTROL_REQUESTS_IN_FLIGHT_MAX = 32
#: how long the agent waits for one reply (a rollback of a big step, a drain); then ``TimeoutError``
CONTROL_REPLY_TIMEOUT_S = 300.0
#: how long the agent waits for the share server to be ready (workspaces opened, recovery done)
SHARE_SERVER_START_TIMEOUT_S = 120.0
#: descriptors of RLIMIT_NOFILE that clients can never take: the undo core, sockets, logs, children
DESCRIPTORS_RESERVED = 256
#: what one cached directory entry costs beyond its name's bytes (a str object and a list slot)
DIR_ENTRY_OVERHEAD_BYTES = 64


def listing_cost(names) -> int:
    """What a directory listing of ``names`` costs: ``len(name) + DIR_ENTRY_OVERHEAD_BYTES``
    each — the one count every listing bound uses (a server's kept listings, a bounded
    ``HostFS.listdir``'s ``limit_bytes``)."""
    return sum(map(len, names)) + DIR_ENTRY_OVERHEAD_BYTES * len(names)


#: what every server listing's "." and ".." cost (:func:`listing_cost`): the rest of the room
#: left in ``dir_listing_bytes_per_connection_max`` is what the host may read of a directory
LISTING_DOTS_COST = listing_cost([".", ".."])


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The limits of one protocol server (table in the module docstring)."""

    msize_bytes_max: int = 1 * MiB
    connections_max: int = 16
    frame_bytes_before_version_max: int = 8 * KiB
    frame_incomplete_timeout_s: float = 60.0
    write_buffer_bytes_max: int = 8 * MiB
    held_request_bytes_per_connection_max: int = 8 * MiB
    fids_per_connection_max: int = 65_536
    open_files_per_connection_max: int = 1_024
    open_files_per_connection_share_max: float = 0.25  # of DescriptorBudget.capacity: 3 abusers leave some
    xattr_bytes_per_connection_max: int = 1 * MiB
    dir_listing_bytes_per_connection_max: int = 16 * MiB
    held_requests_per_export_max: int = HELD_REQUESTS_PER_EXPORT_MAX
    locks_per_export_max: int = LOCKS_PER_EXPORT_MAX
    xattr_value_bytes_max: int = XATTR_VALUE_BYTES_MAX

    def __post_init__(self):
        if self.msize_bytes_max < MSIZE_BYTES_MIN:
            raise ValueError(f"msize_bytes_max must be at least {MSIZE_BYTES_MIN}")
        if self.frame_bytes_before_version_max < 64:
            raise ValueError("frame_bytes_before_version_max must leave room for a Tversion")
        if self.xattr_bytes_per_connection_max < self.xattr_value_bytes_max:
            raise ValueError("xattr_bytes_per_connection_max must hold at least one value")
        counts = (self.connections_max, self.write_buffer_bytes_max, self.held_request_bytes_per_connection_max,
                  self.fids_per_connection_max, self.open_files_per_connection_max,
                  self.dir_listing_bytes_per_connection_max, self.held_requests_per_export_max,
                  self.locks_per_export_max)
        if min(counts) < 1 or not self.frame_incomplete_timeout_s > 0:
            raise ValueError("limits must be positive")
        if not 0 < self.open_files_per_connection_share_max <= 1:
            raise ValueError("open_files_per_connection_share_max must be in (0, 1]")


def raise_nofile_soft_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit now.

    Idempotent. The usual soft limit (1,024) is what one busy client could use up on its
    own; the hard limit is what the administrator allows. A failure leaves the limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
        else:
            log.info("open-file limit raised from %d to %d", soft, hard)
            soft = hard
    return soft


def _nofile_soft() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


class DescriptorBudget:
    """The host descriptors clients of this process's servers may hold (their open files).

    Capacity = ``nofile()`` (the soft ``RLIMIT_NOFILE``, read at each call) − ``reserved``
    − the sockets reserved by running servers (:meth:`reserve_sockets`, one per possible
    connection). :meth:`acquire` beyond it raises ``ENFILE``, so a client gets a clean
    errno while the undo core keeps ``reserved`` descriptors it can always open.
    Thread-safe: servers may run on several event loops of one process."""

    def __init__(self, reserved: int = DESCRIPTORS_RESERVED, nofile=_nofile_soft):
        self.reserved = reserved
        self._nofile = nofile
        self._lock = threading.Lock()
        self._sockets = 0
        self.held = 0

    @property
    def capacity(self) -> int:
        return max(0, self._nofile() - self.reserved - self._sockets)

    def reserve_sockets(self, n: int) -> None:
        with self._lock:
            self._sockets += n
        if self.capacity == 0:
            log.warning("RLIMIT_NOFILE %d leaves no descriptors for clients' open files (%d reserved, "
                        "%d connection sockets): every open will fail with ENFILE",
                        self._nofile(), self.reserved, self._sockets)

    def release_sockets(self, n: int) -> None:
        with self._lock:
            self._sockets -= n
            assert self._sockets >= 0

    def acquire(self, capacity: int | None = None) -> None:
        """Count one descriptor more; ``ENFILE`` at :attr:`capacity` — or at ``capacity``, a
        value of it the caller read just before (one ``getrlimit`` fewer)."""
        with self._lock:
            cap = self.capacity if capacity is None else capacity
            if self.held >= cap:
                raise OSError(errno.ENFILE, f"the server's {cap} descriptors for open files are in use")
            self.held += 1

    def release(self) -> None:
        with self._lock:
            assert self.held > 0, "descriptor released twice"
            self.held -= 1


#: the budget every server of this process shares unless given its own
PROCESS_DESCRIPTORS = DescriptorBudget()
