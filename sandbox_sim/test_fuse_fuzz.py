"""Fuzzing the FUSE request decoder: hostile bytes give a request or a ProtocolError, and
whatever decodes is a request the dispatcher can trust.

One property, :func:`check_one`, driven two ways:

* Hypothesis (always): valid requests from the independent reference encoder of
  ``test_fuse_codec.py``, then mutated -- bytes flipped (the ``len`` field kept right or
  not), truncated with ``len`` fixed up, the body put under another opcode, extension
  lengths that lie, random bytes;
* atheris (coverage-guided, when installed): ``python -m sandbox_sim.test_fuse_fuzz
  -runs=N``; the test below runs it for a bounded number of inputs, or skips saying
  atheris is absent (it is not a dependency).

What "trust" means: only :class:`ProtocolError` escapes (with ``unique`` whenever the
header was readable); a decoded request has ``header.len == len(buf)``, names of 1..255
bytes without NUL or ``/``, symlink targets of 1..4095 bytes, xattr names of 1..255 and
values of at most 65536 bytes, WRITE data of exactly ``size`` <= MAX_WRITE_BYTES bytes;
and decoding is a fixed point: the reference re-encoding of a decoded request decodes to
the same request.
"""

from __future__ import annotations

import importlib.util
import inspect
import struct
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.codec import ProtocolError, decode_request
from sandbox_sim.budget import scale
from sandbox_sim.test_fuse_codec import ref_request, requests

pytestmark = pytest.mark.timeout(300)

_NAMED = {"name": abi.NAME_BYTES_MAX, "oldname": abi.NAME_BYTES_MAX, "newname": abi.NAME_BYTES_MAX}


def _check_request(r: m.Request, buf: bytes, setxattr_ext: bool) -> None:
    assert r.header.len == len(buf) <= abi.REQUEST_BYTES_MAX
    assert type(r) is m.REQUEST_TYPES[r.header.opcode]
    xattr = isinstance(r, (m.Getxattr, m.Setxattr, m.Removexattr))
    for field, limit in _NAMED.items():
        value = getattr(r, field, None)
        if value is None:
            continue
        assert 0 < len(value) <= limit and b"\0" not in value
        assert xattr or b"/" not in value
    if isinstance(r, m.Symlink):
        assert 0 < len(r.target) <= abi.SYMLINK_TARGET_BYTES_MAX and b"\0" not in r.target
    if isinstance(r, m.Setxattr):
        assert len(r.value) == r.size <= abi.XATTR_VALUE_BYTES_MAX
    if isinstance(r, m.Write):
        assert len(r.data) == r.size <= abi.MAX_WRITE_BYTES
    again = ref_request(r, compat_setxattr=not setxattr_ext)
    assert decode_request(again, setxattr_ext=setxattr_ext) == replace(r, header=replace(r.header, len=len(again)))


def check_one(buf: bytes, setxattr_ext: bool = False) -> None:
    """The fuzz property for one input (shared by Hypothesis and atheris)."""
    try:
        r = decode_request(buf, setxattr_ext=setxattr_ext)
    except ProtocolError as e:
        # nobody to answer: no readable header, or its unique is 0 (the notifications' id)
        unreadable = len(buf) < abi.IN_HEADER_SIZE or struct.unpack_from("<Q", buf, 8)[0] == 0
        assert (e.unique is None) == unreadable
        return
    assert r.header.unique or r.OPCODE in m.NO_REPLY  # only FORGETs may carry no id
    _check_request(r, buf, setxattr_ext)


def _fix_len(raw: bytes | bytearray) -> bytes:
    return struct.pack("<I", len(raw)) + bytes(raw[4:]) if len(raw) >= 4 else bytes(raw)


@st.composite
def hostile(draw) -> bytes:
    wire = bytearray(ref_request(draw(requests())))
    kind = draw(st.integers(0, 5))
    if kind == 0:  # bytes flipped, len kept right
        for _ in range(draw(st.integers(1, 6))):
            wire[draw(st.integers(4, len(wire) - 1))] = draw(st.integers(0, 255))
        return bytes(wire)
    if kind == 1:  # bytes flipped anywhere
        for _ in range(draw(st.integers(1, 6))):
            wire[draw(st.integers(0, len(wire) - 1))] = draw(st.integers(0, 255))
        return bytes(wire)
    if kind == 2:  # truncated or extended, len fixed up
        cut = draw(st.integers(0, len(wire) + 40))
        return _fix_len(wire[:cut] + bytes(max(0, cut - len(wire))))
    if kind == 3:  # the body under another opcode
        struct.pack_into("<I", wire, 4, draw(st.sampled_from(sorted(m.REQUEST_TYPES)) | st.integers(0, 2**32 - 1)))
        return bytes(wire)
    if kind == 4:  # total_extlen that may lie
        struct.pack_into("<H", wire, 32, draw(st.integers(0, 0xFFFF)))
        return bytes(wire)
    return draw(st.binary(max_size=200))


@settings(max_examples=scale(600, 20000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buf=hostile(), ext=st.booleans())
def test_hostile_requests_decode_to_trustworthy_requests_or_protocol_errors(buf, ext):
    check_one(buf, ext)


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed (optional)")
def test_atheris_harness_runs_clean():
    runs = scale(20_000, 1_000_000)
    out = subprocess.run([sys.executable, "-m", "sandbox_sim.test_fuse_fuzz", f"-runs={runs}"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]


def _seed_corpus(directory: str) -> None:
    """One valid request of every type (from the reference encoder) to start from."""
    from hypothesis import find

    for i, op in enumerate(sorted(m.REQUEST_TYPES)):
        r = find(requests(m.REQUEST_TYPES[op].__name__), lambda r: True)
        with open(f"{directory}/seed{i}", "wb") as f:
            f.write(b"\x01" + ref_request(r))


def _atheris_main() -> None:  # pragma: no cover - needs atheris
    import tempfile

    import atheris

    from sandbox.fuse import codec

    # coverage feedback from the codec only (instrument_all would instrument Hypothesis too)
    for fn in [*vars(codec).values(), *codec._DISPATCH.values()]:
        if inspect.isfunction(fn) and fn.__module__ == codec.__name__:
            atheris.instrument_func(fn)

    def one(data: bytes) -> None:
        if not data:
            return
        check_one(data[1:], setxattr_ext=bool(data[0] & 1))

    argv = list(sys.argv)
    with tempfile.TemporaryDirectory() as corpus:
        if not any(not a.startswith("-") for a in argv[1:]):
            _seed_corpus(corpus)
            argv.append(corpus)
        atheris.Setup(argv, one)
        atheris.Fuzz()


if __name__ == "__main__":  # pragma: no cover
    _atheris_main()
