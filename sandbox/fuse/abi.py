"""The Linux FUSE ABI we speak: opcodes, flag bits and the size limits of the codec.

Facts from ``include/uapi/linux/fuse.h`` (protocol 7.38, the header of the build machine);
pure constants, no I/O. Layouts of the structs live in :mod:`sandbox.fuse.codec`.

Invariants:

* Every value here equals its fuse.h definition (``sandbox_sim/test_fuse_codec.py`` checks
  them against a table typed out separately from the header).
* The limits are the codec's real bounds: :func:`~sandbox.fuse.codec.decode_request`
  refuses anything larger with a :class:`~sandbox.fuse.messages.ProtocolError`, and the
  transport reads ``/dev/fuse`` with a buffer of :data:`READ_BUFFER_BYTES`.
"""

from __future__ import annotations

import enum

# ---------------------------------------------------------------------------------------
# Versions
# ---------------------------------------------------------------------------------------

KERNEL_VERSION = 7  # FUSE_KERNEL_VERSION: the only major we speak
KERNEL_MINOR_VERSION = 38  # the minor we answer INIT with (struct layouts of fuse.h 7.38)
KERNEL_MINOR_VERSION_MIN = 31  # an older kernel's INIT is refused (EPROTO)

FUSE_ROOT_ID = 1


class Opcode(enum.IntEnum):
    """``enum fuse_opcode``. The codec decodes the requests listed in the issue; the rest
    (BMAP, IOCTL, POLL, NOTIFY_REPLY, SETUPMAPPING, REMOVEMAPPING, SYNCFS, TMPFILE, CUSE)
    decode to :class:`~sandbox.fuse.messages.UnknownOpcode` (answered ENOSYS)."""

    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42  # no reply
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    CUSE_INIT = 4096


class NotifyCode(enum.IntEnum):
    """``enum fuse_notify_code``: the ``error`` field of a notification (``unique`` 0)."""

    POLL = 1
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4
    RETRIEVE = 5
    DELETE = 6


# ---------------------------------------------------------------------------------------
# INIT flags (fuse_init_in.flags / fuse_init_out.flags; bits >= 32 travel in flags2 when
# FUSE_INIT_EXT is set on both sides)
# ---------------------------------------------------------------------------------------

FUSE_ASYNC_READ = 1 << 0
FUSE_POSIX_LOCKS = 1 << 1
FUSE_FILE_OPS = 1 << 2
FUSE_ATOMIC_O_TRUNC = 1 << 3
FUSE_EXPORT_SUPPORT = 1 << 4
FUSE_BIG_WRITES = 1 << 5
FUSE_DONT_MASK = 1 << 6
FUSE_SPLICE_WRITE = 1 << 7
FUSE_SPLICE_MOVE = 1 << 8
FUSE_SPLICE_READ = 1 << 9
FUSE_FLOCK_LOCKS = 1 << 10
FUSE_HAS_IOCTL_DIR = 1 << 11
FUSE_AUTO_INVAL_DATA = 1 << 12
FUSE_DO_READDIRPLUS = 1 << 13
FUSE_READDIRPLUS_AUTO = 1 << 14
FUSE_ASYNC_DIO = 1 << 15
FUSE_WRITEBACK_CACHE = 1 << 16
FUSE_NO_OPEN_SUPPORT = 1 << 17
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_HANDLE_KILLPRIV = 1 << 19
FUSE_POSIX_ACL = 1 << 20
FUSE_ABORT_ERROR = 1 << 21
FUSE_MAX_PAGES = 1 << 22
FUSE_CACHE_SYMLINKS = 1 << 23
FUSE_NO_OPENDIR_SUPPORT = 1 << 24
FUSE_EXPLICIT_INVAL_DATA = 1 << 25
FUSE_MAP_ALIGNMENT = 1 << 26
FUSE_SUBMOUNTS = 1 << 27
FUSE_HANDLE_KILLPRIV_V2 = 1 << 28
FUSE_SETXATTR_EXT = 1 << 29
FUSE_INIT_EXT = 1 << 30
FUSE_INIT_RESERVED = 1 << 31
FUSE_SECURITY_CTX = 1 << 32
FUSE_HAS_INODE_DAX = 1 << 33
FUSE_HAS_EXPIRE_ONLY = 1 << 35

# ---------------------------------------------------------------------------------------
# Per-request flag bits
# ---------------------------------------------------------------------------------------

# fuse_setattr_in.valid
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_LOCKOWNER = 1 << 9
FATTR_CTIME = 1 << 10
FATTR_KILL_SUIDGID = 1 << 11

# fuse_open_out.open_flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_STREAM = 1 << 4
FOPEN_NOFLUSH = 1 << 5
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6

# fuse_open_in.open_flags / fuse_create_in.open_flags
FUSE_OPEN_KILL_SUIDGID = 1 << 0

# fuse_release_in.release_flags
FUSE_RELEASE_FLUSH = 1 << 0
FUSE_RELEASE_FLOCK_UNLOCK = 1 << 1

# fuse_getattr_in.getattr_flags
FUSE_GETATTR_FH = 1 << 0

# fuse_lk_in.lk_flags
FUSE_LK_FLOCK = 1 << 0

# fuse_write_in.write_flags
FUSE_WRITE_CACHE = 1 << 0
FUSE_WRITE_LOCKOWNER = 1 << 1
FUSE_WRITE_KILL_SUIDGID = 1 << 2

# fuse_read_in.read_flags
FUSE_READ_LOCKOWNER = 1 << 1

# fuse_fsync_in.fsync_flags
FUSE_FSYNC_FDATASYNC = 1 << 0

# fuse_attr.flags
FUSE_ATTR_SUBMOUNT = 1 << 0
FUSE_ATTR_DAX = 1 << 1

# fuse_setxattr_in.setxattr_flags
FUSE_SETXATTR_ACL_KILL_SGID = 1 << 0

# fuse_notify_inval_entry_out.flags
FUSE_EXPIRE_ONLY = 1 << 0

# RENAME2 flags (linux/fs.h)
RENAME_NOREPLACE = 1 << 0
RENAME_EXCHANGE = 1 << 1
RENAME_WHITEOUT = 1 << 2

# FALLOCATE modes (linux/falloc.h)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

# ---------------------------------------------------------------------------------------
# Sizes and limits
# ---------------------------------------------------------------------------------------

IN_HEADER_SIZE = 40  # sizeof(struct fuse_in_header)
OUT_HEADER_SIZE = 16  # sizeof(struct fuse_out_header)
WRITE_IN_SIZE = 40  # sizeof(struct fuse_write_in)
FUSE_MIN_READ_BUFFER = 8192  # the kernel refuses a smaller read() on /dev/fuse
PAGE_SIZE = 4096

#: the largest WRITE payload we negotiate (fuse_init_out.max_write)
MAX_WRITE_BYTES = 1 << 20
#: max_pages answered with FUSE_MAX_PAGES: room for one MAX_WRITE_BYTES request
MAX_PAGES = MAX_WRITE_BYTES // PAGE_SIZE
#: without FUSE_MAX_PAGES the kernel caps a request at 32 pages
DEFAULT_MAX_PAGES = 32
#: the largest request decode_request accepts: header + write header + MAX_WRITE_BYTES
REQUEST_BYTES_MAX = IN_HEADER_SIZE + WRITE_IN_SIZE + MAX_WRITE_BYTES
#: the transport's read buffer (the kernel's minimum is max(8192, 80 + max_write))
READ_BUFFER_BYTES = max(FUSE_MIN_READ_BUFFER, REQUEST_BYTES_MAX)

#: a file name (NAME_MAX); longer: ProtocolError(ENAMETOOLONG)
NAME_BYTES_MAX = 255
#: a symlink target without its NUL (PATH_MAX - 1); longer: ProtocolError(ENAMETOOLONG)
SYMLINK_TARGET_BYTES_MAX = 4095
#: an xattr name (XATTR_NAME_MAX); longer: ProtocolError(ERANGE), as setxattr(2) answers
XATTR_NAME_BYTES_MAX = 255
#: an xattr value (XATTR_SIZE_MAX); larger: ProtocolError(E2BIG), as setxattr(2) answers
XATTR_VALUE_BYTES_MAX = 65536
#: a reply's error is -errno with 0 < errno < 512 (the kernel rejects anything else)
ERRNO_MAX = 511
#: the time granularity we answer INIT with (nanoseconds: full precision)
TIME_GRAN_NS = 1
#: INIT answers when the dispatcher does not choose (the kernel's own defaults)
DEFAULT_MAX_BACKGROUND = 12
DEFAULT_CONGESTION_THRESHOLD = 9
#: a READDIR/READDIRPLUS reply is at most this many bytes, whatever size the kernel asks
READDIR_BYTES_MAX = MAX_WRITE_BYTES
DIRENT_HEADER_SIZE = 24  # offsetof(struct fuse_dirent, name)
DIRENTPLUS_HEADER_SIZE = 152  # offsetof(struct fuse_direntplus, dirent.name)
ENTRY_OUT_SIZE = 128  # sizeof(struct fuse_entry_out)
