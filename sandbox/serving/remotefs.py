"""API writes to a folder a share-server process serves: the agent's provider for it.

In ``share_servers="process"`` mode the undo core of a read-write folder lives in the
child (:mod:`sandbox.serving.shareserver`); an API client's writes
(:class:`~sandbox.files.FileService`: STDIO ``fs.*``, the SDK's ``sb.files``) must reach
that core, so they are API steps and undoable exactly as in thread mode.

:func:`remote_provider` is an ordinary :class:`~sandbox.mounts.provider.Provider` whose
``host`` is the folder on disk (reads: ``getattr``/``listdir``/read-only opens go straight
to disk) and whose ``fs`` is a :class:`RemoteFS`: each mutation the provider makes —
create, open for writing, ``pwrite``, truncate, chmod, mkdir, rename, unlink, xattrs … —
is one ``fs`` request on the control channel, run by the child on the folder's real
:class:`~sandbox.core.intercepted_fs.InterceptedFS`. Why this and not a 9P client
(:class:`~sandbox.ninep.wirefs.WireFS`): the 9P server's gate *waits* on a safeguard hold,
but an API write must be refused at once (FileService's rule); over the channel the
child's core raises :class:`~sandbox.core.errors.HoldRequired` and it comes back as that
class (:func:`~sandbox.serving.remote.raise_remote`), so FileService denies it the same
way; and the provider's own rules (views, guest modes, set-id bits) stay in one place,
used unchanged.

A handle opened for writing lives in the child (a :class:`RemoteHandle` here names it by
number); the child holds at most :data:`REMOTE_HANDLES_MAX` — one more is ``EMFILE``.
Bytes travel base64 in chunks of at most :data:`REMOTE_FS_CHUNK_BYTES` (a line stays well
under ``CONTROL_LINE_BYTES_MAX``); a large write is several ``pwrite`` requests of the
same step. Errors come back as the same ``OSError`` subclass with the same errno.
"""

from __future__ import annotations

import base64
import errno
import os
import threading

from ..hostfs import Attr, FileHandle
from ..mounts import Provider

REMOTE_FS_CHUNK_BYTES = 256 << 10  # bytes of one pwrite/pread request (base64: ~342 KiB on the line)
REMOTE_HANDLES_MAX = 256  # open handles the child keeps for the agent's API clients; more: EMFILE

#: the InterceptedFS mutations the agent may ask for (``fs`` request): path-based ones …
PATH_METHODS = frozenset({"chmod", "truncate", "utime", "mkdir", "symlink", "link", "rename", "unlink", "rmdir",
                          "setxattr", "removexattr"})
#: … and the handle-based ones (the handle is the child's, named by number)
HANDLE_METHODS = frozenset({"pwrite", "ftruncate", "fchmod", "futime", "fsetxattr", "fremovexattr"})
#: what the agent may do to an open handle directly (``handle`` request): nothing that mutates
HANDLE_QUERIES = frozenset({"pread", "fstat", "listxattr", "getxattr", "fsync", "close"})


def b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


class RemoteHandle(FileHandle):
    """A file open in the child, by number. Mutations go through :class:`RemoteFS` (the
    undo core sees them); this class only reads, syncs and closes."""

    def __init__(self, share, directory: int, hid: int, path: str, flags: int):
        self.share = share
        self.directory = directory
        self.id = hid
        self.path = path
        self.flags = flags
        self._closed = False

    def _ask(self, method: str, **args):
        if self._closed:
            raise OSError(errno.EBADF, "handle closed", self.path)
        return self.share.request("handle", {"directory": self.directory, "handle": self.id, "method": method,
                                             "args": args})

    def pread(self, length: int, offset: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            want = min(length - len(out), REMOTE_FS_CHUNK_BYTES)
            chunk = unb64(self._ask("pread", length=want, offset=offset + len(out)))
            out += chunk
            if len(chunk) < want:
                break
        return bytes(out)

    def fstat(self) -> Attr:
        return Attr(**self._ask("fstat"))

    def listxattr(self) -> list[str]:
        return list(self._ask("listxattr"))

    def getxattr(self, name: str) -> bytes:
        return unb64(self._ask("getxattr", name=name))

    def fsync(self, datasync: bool = False) -> None:
        self._ask("fsync", datasync=datasync)

    def close(self) -> None:
        if not self._closed:
            try:
                self._ask("close")
            finally:
                self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _mutation(self, *_a, **_k):
        raise OSError(errno.EPERM, "a remote handle is changed through its provider (the undo core)", self.path)

    pwrite = truncate = chmod = utime = chown = setxattr = removexattr = fallocate = copy_range_to = _mutation


class RemoteFS:
    """InterceptedFS's mutation surface for folder ``directory`` of ``share`` (module
    docstring); read-only opens use ``host`` (the folder on disk)."""

    interceptor = None  # the undo core is the child's: holds are resolved through the RemoteWorkspace

    def __init__(self, share, directory: int, host):
        self.share = share
        self.directory = directory
        self.host = host

    def _fs(self, method: str, handle: FileHandle | None = None, **args):
        req = {"directory": self.directory, "method": method, "args": args}
        if handle is not None:
            if not isinstance(handle, RemoteHandle) or handle.closed:
                raise OSError(errno.EBADF, "not an open handle of this share server", getattr(handle, "path", ""))
            req["handle"] = handle.id
        return self.share.request("fs", req)

    def _handle(self, reply: dict, path: str, flags: int) -> RemoteHandle:
        return RemoteHandle(self.share, self.directory, int(reply["handle"]), path, flags)

    # -- opens
    def open(self, path: str, flags: int) -> FileHandle:
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & (os.O_TRUNC | os.O_APPEND):
            return self.host.open(path, flags)  # a read: straight from disk
        return self._handle(self._fs("open", path=path, flags=flags), path, flags)

    def create_handle(self, path: str, mode: int = 0o644, flags: int = os.O_WRONLY) -> FileHandle:
        return self._handle(self._fs("create_handle", path=path, mode=mode, flags=flags), path, flags)

    # -- handle mutations
    def pwrite(self, handle: FileHandle, path: str, offset: int, data: bytes) -> int:
        view, done = memoryview(bytes(data)), 0
        while True:  # at least one request: an empty write is still seen by the undo core
            n = int(self._fs("pwrite", handle, path=path, offset=offset + done,
                             data=b64(view[done:done + REMOTE_FS_CHUNK_BYTES])))
            done += n
            if done >= len(view):
                return done
            if n <= 0:
                raise OSError(errno.EIO, f"write made no progress on {path!r}")

    def ftruncate(self, handle: FileHandle, path: str, size: int) -> None:
        self._fs("ftruncate", handle, path=path, size=size)

    def fchmod(self, handle: FileHandle, path: str, mode: int) -> None:
        self._fs("fchmod", handle, path=path, mode=mode)

    def futime(self, handle: FileHandle, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._fs("futime", handle, path=path, mtime_ns=mtime_ns, atime_ns=atime_ns)

    def fsetxattr(self, handle: FileHandle, path: str, name: str, value: bytes) -> None:
        self._fs("fsetxattr", handle, path=path, name=name, value=b64(value))

    def fremovexattr(self, handle: FileHandle, path: str, name: str) -> None:
        self._fs("fremovexattr", handle, path=path, name=name)

    # -- path mutations
    def chmod(self, path: str, mode: int) -> None:
        self._fs("chmod", path=path, mode=mode)

    def truncate(self, path: str, size: int) -> None:
        self._fs("truncate", path=path, size=size)

    def utime(self, path: str, mtime_ns: int, atime_ns: int | None = None) -> None:
        self._fs("utime", path=path, mtime_ns=mtime_ns, atime_ns=atime_ns)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._fs("mkdir", path=path, mode=mode)

    def symlink(self, target: str, path: str) -> None:
        self._fs("symlink", target=target, path=path)

    def link(self, existing: str, new: str) -> None:
        self._fs("link", existing=existing, new=new)

    def rename(self, src: str, dst: str) -> None:
        self._fs("rename", src=src, dst=dst)

    def unlink(self, path: str) -> None:
        self._fs("unlink", path=path)

    def rmdir(self, path: str) -> None:
        self._fs("rmdir", path=path)

    def setxattr(self, path: str, name: str, value: bytes) -> None:
        self._fs("setxattr", path=path, name=name, value=b64(value))

    def removexattr(self, path: str, name: str) -> None:
        self._fs("removexattr", path=path, name=name)


def remote_provider(share, directory: int, path: str, label: str) -> Provider:
    """The agent's provider of read-write folder ``directory`` served by ``share`` (module docstring)."""
    from ..hostfs.real import RealHostFS

    host = RealHostFS(path, name=label or "work")
    return Provider(host, RemoteFS(share, directory, host), read_only=False, label=label)


class FsDoor:
    """The child's side of the ``fs``/``handle`` requests: folder ``i``'s InterceptedFS
    (``fs_of(i)``) and the table of handles opened for the agent (at most
    :data:`REMOTE_HANDLES_MAX`; all closed by :meth:`close_all`)."""

    def __init__(self, fs_of):
        self.fs_of = fs_of
        self.handles: dict[int, tuple[int, FileHandle]] = {}
        self._next = 1
        self._lock = threading.Lock()  # requests run on threads of their own

    def _keep(self, directory: int, fh: FileHandle) -> dict:
        with self._lock:
            if len(self.handles) < REMOTE_HANDLES_MAX:
                hid, self._next = self._next, self._next + 1
                self.handles[hid] = (directory, fh)
                return {"handle": hid}
        fh.close()
        raise OSError(errno.EMFILE, f"the share server keeps at most {REMOTE_HANDLES_MAX} API handles "
                      "(REMOTE_HANDLES_MAX)")

    def _handle(self, directory: int, hid) -> FileHandle:
        got = self.handles.get(hid)
        if got is None or got[0] != directory:
            raise OSError(errno.EBADF, f"no open handle {hid!r}")
        return got[1]

    def fs(self, args: dict):
        """One ``fs`` request: ``directory``, ``method``, ``args`` (and ``handle``)."""
        i, method, a = args["directory"], args.get("method"), dict(args.get("args") or {})
        fs = self.fs_of(i)
        if "value" in a:
            a["value"] = unb64(a["value"])
        if method == "open":
            return self._keep(i, fs.open(a["path"], int(a["flags"])))
        if method == "create_handle":
            return self._keep(i, fs.create_handle(a["path"], int(a["mode"]), int(a["flags"])))
        if method in HANDLE_METHODS:
            fh = self._handle(i, args.get("handle"))
            if method == "pwrite":
                return fs.pwrite(fh, a["path"], int(a["offset"]), unb64(a["data"]))
            return getattr(fs, method)(fh, **a)
        if method in PATH_METHODS:
            return getattr(fs, method)(**a)
        raise ValueError(f"no such fs method: {method!r}")

    def handle(self, args: dict):
        """One ``handle`` request: ``directory``, ``handle``, ``method`` of :data:`HANDLE_QUERIES`, ``args``."""
        i, hid, method, a = args["directory"], args.get("handle"), args.get("method"), dict(args.get("args") or {})
        if method not in HANDLE_QUERIES:
            raise ValueError(f"no such handle method: {method!r}")
        fh = self._handle(i, hid)
        if method == "close":
            with self._lock:
                self.handles.pop(hid, None)
            fh.close()
            return None
        if method == "pread":
            return b64(fh.pread(min(int(a["length"]), REMOTE_FS_CHUNK_BYTES), int(a["offset"])))
        if method == "getxattr":
            return b64(fh.getxattr(a["name"]))
        if method == "fsync":
            return fh.fsync(bool(a.get("datasync")))
        return getattr(fh, method)()

    def close_all(self) -> None:
        with self._lock:
            handles, self.handles = self.handles, {}
        for _i, fh in handles.values():
            fh.close()
