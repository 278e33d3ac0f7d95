"""Sans-I/O 9P2000.L codec: one whole frame in, one typed message out -- and back.

No sockets, no asyncio, no state beyond :class:`FrameSplitter`'s buffer: the caller owns
all I/O (h11's rule, STYLE.md). Servers and clients are loops around three calls::

    frames = splitter.feed(received_bytes)      # framing: whole frames only
    tag, msg = decode(frame)                    # bytes -> Message (T or R)
    wire = encode(tag, reply)                   # Message -> bytes

Invariants:

* **Only ProtocolError escapes decode.** Whatever the bytes, :func:`decode` returns a
  message or raises :class:`ProtocolError` -- never IndexError, struct.error,
  UnicodeError, MemoryError from an attacker-chosen size. ``ProtocolError.tag`` is set
  whenever the 7-byte header was readable, so a server can answer ``Rlerror(EINVAL)``
  to that tag and keep the session.
* **Every decoder bounds its sizes.** The size field must equal the frame's length and
  be >= 7; every string, data count, walk-name and walk-qid count is checked against the
  bytes actually present before anything is sliced or allocated; ``nwname``/``nwqid``
  are at most 16; a ``count[4]`` must equal the bytes that follow it; no trailing bytes.
  Strings decode with ``surrogateescape`` (cannot fail; non-UTF-8 names round-trip).
* **encode refuses what decode could not produce.** Out-of-range integers, strings over
  65535 bytes, more than 16 walk elements -> ValueError (wrong Python types ->
  TypeError). ``decode(encode(tag, m)) == (tag, m)`` for every valid ``m``.
* **FrameSplitter bounds its buffer.** A size field < 7 or > ``msize`` raises
  ProtocolError (the caller closes the connection: framing is lost); otherwise it holds
  at most one partial frame, and reassembly is linear in the bytes fed.

Table-driven: each message class's ``WIRE`` spec (see :mod:`.messages`) is compiled once,
at import, into a specialised decoder and encoder -- straight-line Python with one
precompiled :class:`struct.Struct` per run of fixed-size fields (the header is folded into
the first run when encoding), so a Tread costs one ``unpack_from`` and a Twrite's payload
is sliced once, never walked byte by byte. :func:`generated_source` shows the code.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import fields
from types import MemberDescriptorType

from .messages import (
    HEADER_SIZE,
    MESSAGE_TYPES,
    STRING_BYTES_MAX,
    WALK_NAMES_MAX,
    Message,
    ProtocolError,
    Qid,
)

__all__ = ["FrameSplitter", "ProtocolError", "decode", "encode", "generated_source"]

_HEADER = struct.Struct("<IBH")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_QID = struct.Struct("<BIQ")
_SCALAR = {"b": "B", "w": "H", "d": "I", "q": "Q"}
_LIMITS = {"B": 0xFF, "H": 0xFFFF, "I": 0xFFFFFFFF, "Q": 0xFFFFFFFFFFFFFFFF}


def _str_bytes(value: object) -> bytes:
    """Encode-side: a string field given as ``str`` (the norm) or bytes-like."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"string field must be str or bytes, not {type(value).__name__}")


def _nbytes(value: object) -> int:
    if isinstance(value, bytes):
        return len(value)
    try:
        return memoryview(value).nbytes  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"data field must be bytes-like, not {type(value).__name__}") from None


# ---------------------------------------------------------------------------------------
# The compiler: WIRE spec -> decoder and encoder source
# ---------------------------------------------------------------------------------------


class _Gen:
    """Builds the two functions for one message class."""

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.names = [f.name for f in fields(cls)]
        self.structs: dict[str, struct.Struct] = {}

    def _struct(self, codes: str) -> str:
        key = f"_S_{codes}"
        self.structs.setdefault(key, struct.Struct("<" + codes))
        return key

    def _runs(self) -> list[tuple[str, list[tuple[str, int]]]]:
        """Split the spec into fixed runs, each optionally ending with one variable item.

        Returns ``[(codes, items)]``: ``codes`` is the struct format of the run (a
        variable item contributes its length prefix), ``items`` the (letter, field index)
        pairs it covers; only the last item of a run may be variable (s/D/T/R).
        """
        runs: list[tuple[str, list[tuple[str, int]]]] = []
        codes, items = "", []
        for i, letter in enumerate(self.cls.WIRE):
            items.append((letter, i))
            if letter in _SCALAR:
                codes += _SCALAR[letter]
            elif letter == "Q":
                codes += "BIQ"
            else:
                codes += "I" if letter == "D" else "H"
                runs.append((codes, items))
                codes, items = "", []
        if items or not runs:
            runs.append((codes, items))
        return runs

    # -- decode ---------------------------------------------------------------------

    def decoder(self) -> str:
        name, wire = self.name, self.cls.WIRE
        lines = [f"def _decode_{name}(b, end, tag):"]
        emit = lines.append
        if all(c in _SCALAR or c == "Q" for c in wire):
            total = HEADER_SIZE + struct.calcsize("<" + "".join(_SCALAR.get(c, "BIQ") for c in wire))
            emit(f"    if end != {total}:")
            emit(f"        raise _PE('{name}: body of %d bytes, expected {total - HEADER_SIZE}' % (end - 7), tag)")
        pos: int | None = HEADER_SIZE  # known offset while nothing variable was read
        last_letter = wire[-1] if wire else ""
        for codes, items in self._runs():
            targets = []
            for letter, i in items:
                if letter == "Q":
                    targets += [f"v{i}t", f"v{i}v", f"v{i}p"]
                elif letter in _SCALAR:
                    targets.append(f"v{i}")
                else:
                    targets.append(f"n{i}")
            if codes:
                where = str(pos) if pos is not None else "o"
                emit(f"    {', '.join(targets)}, = {self._struct(codes)}.unpack_from(b, {where})")
                size = struct.calcsize("<" + codes)
                if pos is not None:
                    pos += size
                else:
                    emit(f"    o += {size}")
            for letter, i in items:
                if letter == "Q":
                    emit(f"    v{i} = _new(_Qid)")
                    emit(f"    _Qid_0(v{i}, v{i}t)")
                    emit(f"    _Qid_1(v{i}, v{i}v)")
                    emit(f"    _Qid_2(v{i}, v{i}p)")
            if not items or items[-1][0] not in "sDTR":
                continue
            letter, i = items[-1]
            field = f"{name}.{self.names[i]}"
            if pos is not None:
                emit(f"    o = {pos}")
                pos = None
            if letter == "s":
                emit(f"    e = o + n{i}")
                emit("    if e > end:")
                emit(f"        raise _PE('{field}: string of %d bytes overruns the frame' % n{i}, tag)")
                emit(f"    v{i} = _str(b[o:e], 'utf-8', 'surrogateescape')")
                emit("    o = e")
            elif letter == "D":
                emit(f"    e = o + n{i}")
                cmp = "!=" if i == len(wire) - 1 else ">"
                emit(f"    if e {cmp} end:")
                emit(f"        raise _PE('{field}: count %d but %d bytes present' % (n{i}, end - o), tag)")
                emit(f"    v{i} = _bytes(b[o:e])")
                emit("    o = e")
            elif letter == "T":
                emit(f"    if n{i} > {WALK_NAMES_MAX}:")
                emit(f"        raise _PE('{name}: nwname %d > {WALK_NAMES_MAX}' % n{i}, tag)")
                emit("    names = []")
                emit(f"    for _ in range(n{i}):")
                emit("        k, = _U16_unpack(b, o)")
                emit("        o += 2")
                emit("        e = o + k")
                emit("        if e > end:")
                emit(f"            raise _PE('{field}: name of %d bytes overruns the frame' % k, tag)")
                emit("        names.append(_str(b[o:e], 'utf-8', 'surrogateescape'))")
                emit("        o = e")
                emit(f"    v{i} = tuple(names)")
            elif letter == "R":
                emit(f"    if n{i} > {WALK_NAMES_MAX}:")
                emit(f"        raise _PE('{name}: nwqid %d > {WALK_NAMES_MAX}' % n{i}, tag)")
                emit(f"    e = o + 13 * n{i}")
                emit("    if e > end:")
                emit(f"        raise _PE('{field}: %d qids overrun the frame' % n{i}, tag)")
                emit(f"    v{i} = tuple([_make_qid(*t) for t in _QID_iter(b[o:e])])")
                emit("    o = e")
        if pos is None and last_letter != "D":
            emit("    if o != end:")
            emit(f"        raise _PE('{name}: %d trailing bytes' % (end - o), tag)")
        # Build the result by setting its slots directly: a frozen dataclass's __init__
        # goes through object.__setattr__ per field and costs ~3x more (Rgetattr: 20
        # fields). Equivalent because no message class has a __post_init__.
        emit(f"    r = _new(_C_{name})")
        for i in range(len(wire)):
            emit(f"    _C_{name}_{i}(r, v{i})")
        emit("    return r")
        return "\n".join(lines) + "\n"

    # -- encode ---------------------------------------------------------------------

    def encoder(self) -> str:
        name, wire, names = self.name, self.cls.WIRE, self.names
        lines = [f"def _encode_{name}(tag, m):"]
        emit = lines.append
        fixed_size = HEADER_SIZE
        var_terms: list[str] = []
        # 1. fetch fields, prepare variable parts and their lengths
        for i, letter in enumerate(wire):
            attr = f"m.{names[i]}"
            if letter in _SCALAR:
                emit(f"    v{i} = {attr}")
                fixed_size += struct.calcsize("<" + _SCALAR[letter])
            elif letter == "Q":
                emit(f"    v{i} = {attr}")
                fixed_size += 13
            elif letter == "s":
                emit(f"    v{i} = {attr}")
                emit(f"    v{i} = v{i}.encode(_UTF8, _SE) if v{i}.__class__ is str else _str_bytes(v{i})")
                emit(f"    n{i} = len(v{i})")
                fixed_size += 2
                var_terms.append(f"n{i}")
            elif letter == "D":
                emit(f"    v{i} = {attr}")
                emit(f"    n{i} = len(v{i}) if v{i}.__class__ is bytes else _nbytes(v{i})")
                fixed_size += 4
                var_terms.append(f"n{i}")
            elif letter == "T":
                emit(f"    n{i} = len({attr})")
                emit(f"    if n{i} > {WALK_NAMES_MAX}:")
                emit(f"        raise ValueError('{name}: %d walk names > {WALK_NAMES_MAX}' % n{i})")
                emit(f"    w{i} = [x.encode(_UTF8, _SE) if x.__class__ is str else _str_bytes(x) for x in {attr}]")
                emit(f"    v{i} = b''.join([_U16_pack(len(x)) + x for x in w{i}])")
                fixed_size += 2
                var_terms.append(f"len(v{i})")
            elif letter == "R":
                emit(f"    n{i} = len({attr})")
                emit(f"    if n{i} > {WALK_NAMES_MAX}:")
                emit(f"        raise ValueError('{name}: %d walk qids > {WALK_NAMES_MAX}' % n{i})")
                emit(f"    v{i} = b''.join([_QID_pack(q.type, q.version, q.path) for q in {attr}])")
                fixed_size += 2
                var_terms.append(f"len(v{i})")
        emit(f"    size = {' + '.join([str(fixed_size)] + var_terms)}")
        # 2. pack the runs, header folded into the first
        pieces: list[str] = []
        for k, (codes, items) in enumerate(self._runs()):
            args: list[str] = []
            if k == 0:
                codes = "IBH" + codes
                args += ["size", str(self.cls.TYPE), "tag"]
            for letter, i in items:
                if letter in _SCALAR:
                    args.append(f"v{i}")
                elif letter == "Q":
                    args += [f"v{i}.type", f"v{i}.version", f"v{i}.path"]
                else:
                    args.append(f"n{i}")
            if codes:
                pieces.append(f"{self._struct(codes)}.pack({', '.join(args)})")
            if items and items[-1][0] in "sDTR":
                pieces.append(f"v{items[-1][1]}")
        if len(pieces) == 1:
            emit(f"    return {pieces[0]}")
        else:
            emit(f"    return b''.join(({', '.join(pieces)}))")
        return "\n".join(lines) + "\n"


def _slot_setter(cls: type, name: str) -> Callable[[object, object], None]:
    descriptor = cls.__dict__[name]
    if not isinstance(descriptor, MemberDescriptorType):  # not slotted: must not bypass __init__
        raise TypeError(f"{cls.__name__}.{name} is not a slot")
    return descriptor.__set__


_QID_SET = [_slot_setter(Qid, f.name) for f in fields(Qid)]


def _make_qid(qtype: int, version: int, path: int, _new=object.__new__, _s=_QID_SET) -> Qid:
    q = _new(Qid)
    _s[0](q, qtype)
    _s[1](q, version)
    _s[2](q, path)
    return q


_DECODERS: dict[int, object] = {}
_ENCODERS: dict[type, object] = {}
_SOURCES: dict[type, str] = {}


def _build() -> None:
    namespace: dict[str, object] = {
        "_PE": ProtocolError,
        "_new": object.__new__,
        "_make_qid": _make_qid,
        "_Qid": Qid,
        **{f"_Qid_{i}": _slot_setter(Qid, f.name) for i, f in enumerate(fields(Qid))},
        "_str": str,
        "_bytes": bytes,
        "_U16_unpack": _U16.unpack_from,
        "_U16_pack": _U16.pack,
        "_QID_iter": _QID.iter_unpack,
        "_QID_pack": _QID.pack,
        "_str_bytes": _str_bytes,
        "_UTF8": "utf-8",
        "_SE": "surrogateescape",
        "_nbytes": _nbytes,
    }
    for type_, cls in MESSAGE_TYPES.items():
        gen = _Gen(cls)
        source = gen.decoder() + "\n" + gen.encoder()
        namespace.update(gen.structs)
        namespace[f"_C_{cls.__name__}"] = cls
        for i, f in enumerate(fields(cls)):
            namespace[f"_C_{cls.__name__}_{i}"] = _slot_setter(cls, f.name)
        # The source is generated from our own WIRE specs, never from input.
        exec(compile(source, f"<ninep codec: {cls.__name__}>", "exec"), namespace)  # noqa: S102
        _DECODERS[type_] = namespace[f"_decode_{cls.__name__}"]
        _ENCODERS[cls] = namespace[f"_encode_{cls.__name__}"]
        _SOURCES[cls] = source


_build()


def generated_source(cls: type[Message]) -> str:
    """The decoder and encoder compiled for ``cls`` (for reading and debugging)."""
    return _SOURCES[cls]


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def decode(frame: bytes | bytearray | memoryview) -> tuple[int, Message]:
    """Decode one whole frame (its 4-byte size included) into ``(tag, message)``.

    Raises :class:`ProtocolError` -- and nothing else -- if the frame is malformed.
    """
    if frame.__class__ is bytes:
        return _decode(frame)  # type: ignore[arg-type]
    # bytearray / memoryview: decode through a flat byte view (slicing it is zero-copy),
    # released before returning so the caller's bytearray can be resized again.
    with memoryview(frame) as view:
        if view.ndim != 1 or view.itemsize != 1:
            try:
                flat = view.cast("B")
            except TypeError:
                flat = memoryview(view.tobytes())
        else:
            flat = view
        with flat:
            return _decode(flat)


def _decode(b: bytes | memoryview) -> tuple[int, Message]:
    n = len(b)
    if n < HEADER_SIZE:
        raise ProtocolError(f"frame of {n} bytes is shorter than the {HEADER_SIZE}-byte header")
    size, type_, tag = _HEADER.unpack_from(b, 0)
    if size != n:
        raise ProtocolError(f"size field {size} != frame length {n}", tag)
    decoder = _DECODERS.get(type_)
    if decoder is None:
        raise ProtocolError(f"unknown message type {type_}", tag)
    try:
        return tag, decoder(b, n, tag)  # type: ignore[operator]
    except struct.error:
        # A fixed-size run ran past the end of the frame (the frame's length is the end).
        raise ProtocolError(f"{MESSAGE_TYPES[type_].__name__}: truncated ({n} bytes)", tag) from None


def encode(tag: int, msg: Message) -> bytes:
    """Encode ``msg`` with ``tag`` into one frame.

    ValueError for out-of-range values (ints beyond their wire width, strings over 65535
    bytes, more than 16 walk elements, a frame over 4 GiB); TypeError for a non-message
    or a field of the wrong Python type.
    """
    encoder = _ENCODERS.get(msg.__class__)
    if encoder is None:
        raise TypeError(f"not a 9P2000.L message: {msg!r}")
    try:
        return encoder(tag, msg)  # type: ignore[operator]
    except struct.error as exc:
        raise _diagnose(tag, msg, exc) from None
    except AttributeError as exc:  # e.g. a qid field holding something that is not a Qid
        raise TypeError(f"{type(msg).__name__}: {exc}") from None


def _check_int(what: str, value: object, code: str) -> Exception | None:
    if not isinstance(value, int):
        return TypeError(f"{what} must be int, not {type(value).__name__}")
    if not 0 <= value <= _LIMITS[code]:
        return ValueError(f"{what} = {value} out of range for u{struct.calcsize(code) * 8}")
    return None


def _diagnose(tag: object, msg: Message, exc: struct.error) -> Exception:
    """Slow path after struct refused a value: name the offending field."""
    name = type(msg).__name__
    problem = _check_int(f"{name} tag", tag, "H")
    if problem:
        return problem
    for f, letter in zip(fields(msg), msg.WIRE):  # type: ignore[arg-type]
        what = f"{name}.{f.name}"
        value = getattr(msg, f.name)
        problem = None
        if letter in _SCALAR:
            problem = _check_int(what, value, _SCALAR[letter])
        elif letter == "Q":
            for part, code in (("type", "B"), ("version", "I"), ("path", "Q")):
                problem = problem or _check_int(f"{what}.{part}", getattr(value, part), code)
        elif letter == "R":
            for q in value:
                for part, code in (("type", "B"), ("version", "I"), ("path", "Q")):
                    problem = problem or _check_int(f"{what}[].{part}", getattr(q, part), code)
        elif letter in "sT":
            for s in [value] if letter == "s" else value:
                if len(_str_bytes(s)) > STRING_BYTES_MAX:
                    problem = ValueError(f"{what}: string of {len(_str_bytes(s))} bytes > {STRING_BYTES_MAX}")
        elif letter == "D" and _nbytes(value) > _LIMITS["I"]:
            problem = ValueError(f"{what}: {_nbytes(value)} bytes do not fit a u32 count")
        if problem:
            return problem
    return ValueError(f"{name}: cannot encode ({exc}); frame too large?")


class FrameSplitter:
    """Cut a byte stream into whole frames (sans-I/O: feed it what ``recv`` returned).

    ``msize`` bounds a frame; set it again after version negotiation. Holds at most one
    partial frame. Copying is linear in the bytes fed: a frame that arrives whole in one
    ``feed`` is returned without a copy; a large frame that arrives in pieces is
    appended to one buffer (amortised O(1) per byte) and cut out once.
    After a :class:`ProtocolError` the stream has lost framing: close the connection.
    """

    __slots__ = ("_buf", "msize")

    def __init__(self, msize: int) -> None:
        if msize < HEADER_SIZE:
            raise ValueError(f"msize {msize} < {HEADER_SIZE}")
        self.msize = msize
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes held back waiting for the rest of a frame."""
        return len(self._buf)

    def _check(self, size: int) -> None:
        if size < HEADER_SIZE:
            raise ProtocolError(f"frame size field {size} < {HEADER_SIZE}")
        if size > self.msize:
            raise ProtocolError(f"frame size field {size} > msize {self.msize}")

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add received bytes; return the complete frames now available, in order."""
        frames: list[bytes] = []
        if not self._buf:
            # Fast path: nothing pending, cut frames straight out of ``data``.
            n = len(data) if data.__class__ is bytes else memoryview(data).nbytes
            if n >= 4:
                size = _U32.unpack_from(data, 0)[0]
                if size == n:
                    self._check(size)
                    frames.append(data if data.__class__ is bytes else bytes(data))  # type: ignore[arg-type]
                    return frames
            with memoryview(data) as view:
                flat = view.cast("B") if view.format != "B" else view
                pos = self._cut(flat, n, 0, frames)
                if pos < n:
                    self._buf += flat[pos:]
            return frames
        self._buf += data
        buf = self._buf
        n = len(buf)
        if n < 4:
            return frames
        # Not enough for the pending frame yet? Avoid creating a view at all.
        size = _U32.unpack_from(buf, 0)[0]
        self._check(size)
        if n < size:
            return frames
        with memoryview(buf) as view:
            pos = self._cut(view, n, 0, frames)
        if pos:
            del buf[:pos]  # moves only the tail: less than one frame
        return frames

    def _cut(self, view: memoryview | bytes, n: int, pos: int, frames: list[bytes]) -> int:
        unpack_from = _U32.unpack_from
        msize = self.msize
        while n - pos >= 4:
            size = unpack_from(view, pos)[0]
            if size < HEADER_SIZE or size > msize:
                self._check(size)
            end = pos + size
            if end > n:
                break
            frames.append(bytes(view[pos:end]))
            pos = end
        return pos
