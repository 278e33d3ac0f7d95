"""The host-side network allowlist proxy (sandbox/vm/netproxy.py), on this machine's
loopback only: upstream servers listen on 127.0.0.x; names are mapped by a test resolver."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys

import pytest

from sandbox.vm import netproxy as np
from sandbox.vm.netproxy import AllowList, NetProxy, ProxyLimits

pytestmark = pytest.mark.timeout(60)

NAMES = {"allowed.test": ["127.0.0.3"], "www.allowed.test": ["127.0.0.3"], "other.test": ["127.0.0.2"]}


async def fake_resolve(name: str) -> list[str]:
    if name not in NAMES:
        raise OSError(f"{name}: no such name")
    return NAMES[name]


# ---------------------------------------------------------------------------- sans-I/O


def test_allowlist_parses_cidrs_and_domains():
    a = AllowList.parse(["10.0.0.0/8", "1.2.3.4", " Example.ORG. ", "*.corp.test", "1.2.3.4/32"])
    assert a.items() == ["10.0.0.0/8", "1.2.3.4/32", "example.org", "corp.test"]
    assert a.allows_ip("10.9.8.7") and a.allows_ip("1.2.3.4") and not a.allows_ip("1.2.3.5")
    assert a.allows_name("example.org") and a.allows_name("api.example.org") and a.allows_name("x.corp.test")
    assert not a.allows_name("badexample.org") and not a.allows_name("example.org.evil.test")
    assert not a.allows_name("org") and not a.allows_ip("example.org")
    for bad in (["nope"], ["::1"], ["300.1.1.1"], ["a b.org"], [""], ["-x.org"], ["1.2.3"]):
        with pytest.raises(ValueError):
            AllowList.parse(bad)


def test_request_heads():
    r = np.parse_request_head(b"CONNECT Allowed.Test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
    assert (r.method, r.host, r.port, r.path) == ("CONNECT", "allowed.test", 443, "")
    r = np.parse_request_head(b"GET http://10.1.2.3:8080/a?b=c HTTP/1.1\r\nHost: x\r\nProxy-Connection: keep-alive\r\n\r\n")
    assert (r.method, r.host, r.port, r.path) == ("GET", "10.1.2.3", 8080, "/a?b=c")
    assert np.origin_head(r) == b"GET /a?b=c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert np.parse_request_head(b"GET http://h.test HTTP/1.0\r\n\r\n").path == "/"
    for bad, status in ((b"CONNECT h.test HTTP/1.1\r\n\r\n", 400),  # no port
                        (b"GET /relative HTTP/1.1\r\n\r\n", 400),
                        (b"GET https://h.test/ HTTP/1.1\r\n\r\n", 400),
                        (b"GET http://h.test:99999/ HTTP/1.1\r\n\r\n", 400),
                        (b"get http://h.test/ HTTP/1.1\r\n\r\n", 400),
                        (b"GET http://h.test/ HTTP/2\r\n\r\n", 400),
                        (b"GET http://h.test/ HTTP/1.1\r\nbad header\r\n\r\n", 400),
                        (b"GET http://h.test/ HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431),
                        (b"GET http://h.test/ HTTP/1.1\r\nX: " + b"y" * 17000 + b"\r\n\r\n", 431)):
        with pytest.raises(np.ProtocolError) as e:
            np.parse_request_head(bad)
        assert e.value.status == status, bad[:60]


def query(name: str, qtype: int = np.QTYPE_A, qid: int = 0x1234) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack("!2H", qtype, 1)


def answers(reply: bytes) -> tuple[int, int, list[str]]:
    qid, flags, _qd, an, _ns, _ar = struct.unpack("!6H", reply[:12])
    records = reply[len(reply) - 16 * an:]  # each: name pointer, type, class, TTL, length, 4 bytes
    addrs = [socket.inet_ntoa(records[16 * k + 12:16 * k + 16]) for k in range(an)]
    return qid, flags & 0xF, addrs


def test_dns_parse_and_reply():
    q = np.parse_dns_query(query("WWW.Allowed.test"))
    assert (q.id, q.name, q.qtype) == (0x1234, "www.allowed.test", 1)
    assert answers(np.dns_reply(q, 0, ["127.0.0.3", "127.0.0.4"])) == (0x1234, 0, ["127.0.0.3", "127.0.0.4"])
    for bad in (b"", b"\0" * 11, query("a.test")[:-2], query("a.test")[:12] + b"\xc0\x0c\0\1\0\1",
                struct.pack("!6H", 1, 0x8100, 1, 0, 0, 0) + query("a.test")[12:],
                query("x" * 64 + ".test")):
        with pytest.raises(np.DnsError):
            np.parse_dns_query(bad)
    assert np.dns_formerr(b"\x12\x34" + b"\0" * 10)[:4] == b"\x12\x34\x80\x81"
    assert np.dns_formerr(b"\0") is None


# ---------------------------------------------------------------------------- the proxy over sockets


class Upstreams:
    """Loopback servers: each answers a line "<name> got <first line>" and echoes the rest."""

    def __init__(self):
        self.servers = {}

    async def add(self, name: str, host: str) -> int:
        async def serve(reader, writer):
            line = await reader.readline()
            writer.write(f"{name} got ".encode() + line)
            await writer.drain()
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, host, 0)
        self.servers[name] = server
        return server.sockets[0].getsockname()[1]

    async def close(self):
        for s in self.servers.values():
            s.close()
            await s.wait_closed()


@pytest.fixture
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


async def with_proxy(tmp_path, allow, body, limits=ProxyLimits()):
    events = []
    proxy = NetProxy(AllowList.parse(allow), resolve=fake_resolve, limits=limits,
                     on_refused=lambda msg, dest: events.append((msg, dest)))
    psock, dsock = str(tmp_path / "proxy.sock"), str(tmp_path / "dns.sock")
    await proxy.start(psock, dsock)
    ups = Upstreams()
    ports = {"a": await ups.add("a", "127.0.0.1"), "b": await ups.add("b", "127.0.0.3"),
             "c": await ups.add("c", "127.0.0.2")}
    try:
        return await body(psock, dsock, ports, events, proxy)
    finally:
        await proxy.close()
        await ups.close()


async def request(psock: str, head: bytes, then: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_unix_connection(psock)
    writer.write(head + then)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    out = await reader.read()
    writer.close()
    return out


def test_connect_allowed_by_cidr_and_by_name_refused_otherwise(tmp_path, run):
    async def body(psock, dsock, ports, events, proxy):
        ok_ip = await request(psock, f"CONNECT 127.0.0.1:{ports['a']} HTTP/1.1\r\n\r\n".encode(), b"hello\nmore")
        ok_name = await request(psock, f"CONNECT www.allowed.test:{ports['b']} HTTP/1.1\r\n\r\n".encode(), b"hi\n")
        no_ip = await request(psock, f"CONNECT 127.0.0.2:{ports['c']} HTTP/1.1\r\n\r\n".encode(), b"x\n")
        no_name = await request(psock, f"CONNECT other.test:{ports['c']} HTTP/1.1\r\n\r\n".encode(), b"x\n")
        return ok_ip, ok_name, no_ip, no_name, events

    ok_ip, ok_name, no_ip, no_name, events = run(with_proxy(tmp_path, ["127.0.0.1/32", "allowed.test"], body))
    assert ok_ip == b"HTTP/1.1 200 Connection established\r\n\r\na got hello\nmore"
    assert ok_name.endswith(b"b got hi\n")
    assert no_ip.startswith(b"HTTP/1.1 403") and b"c got" not in no_ip
    assert no_name.startswith(b"HTTP/1.1 403") and b"c got" not in no_name
    assert len(events) == 2
    assert "127.0.0.2" in events[0][1] and "other.test" in events[1][1]
    assert all("refused" in m for m, _ in events)


def test_plain_http_is_forwarded_in_origin_form(tmp_path, run):
    async def body(psock, dsock, ports, events, proxy):
        ok = await request(psock, f"GET http://allowed.test:{ports['b']}/p?q HTTP/1.1\r\nHost: allowed.test\r\n"
                                  "Proxy-Connection: keep-alive\r\n\r\n".encode())
        no = await request(psock, f"GET http://127.0.0.2:{ports['c']}/ HTTP/1.1\r\n\r\n".encode())
        return ok, no, events

    ok, no, events = run(with_proxy(tmp_path, ["allowed.test"], body))
    # the upstream echoes: its first line, then the rest of the head as sent upstream
    assert ok == b"b got GET /p?q HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
    assert no.startswith(b"HTTP/1.1 403") and len(events) == 1


def test_bounded_head_and_connections(tmp_path, run):
    limits = ProxyLimits(request_head_bytes_max=1024, connections_max=2)

    async def body(psock, dsock, ports, events, proxy):
        big = await request(psock, b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nX: " + b"y" * 4096 + b"\r\n\r\n")
        garbage = await request(psock, b"\x16\x03\x01 not http\r\n\r\n")
        # two connections in flight (their heads incomplete), a third is turned away at once
        held = [await asyncio.open_unix_connection(psock) for _ in range(2)]
        for _, w in held:
            w.write(b"CONNECT ")
            await w.drain()
        while proxy.connections < 2:
            await asyncio.sleep(0)
        third = await request(psock, b"")
        for _, w in held:
            w.close()
        return big, garbage, third

    big, garbage, third = run(with_proxy(tmp_path, ["127.0.0.1/32"], body, limits))
    assert big.startswith(b"HTTP/1.1 431")
    assert garbage.startswith(b"HTTP/1.1 400")
    assert third.startswith(b"HTTP/1.1 503")


async def dns(dsock: str, *msgs: bytes) -> list[bytes]:
    reader, writer = await asyncio.open_unix_connection(dsock)
    out = []
    for m in msgs:
        writer.write(struct.pack("!H", len(m)) + m)
        await writer.drain()
        (n,) = struct.unpack("!H", await reader.readexactly(2))
        out.append(await reader.readexactly(n))
    writer.close()
    return out


def test_dns_answers_allowed_names_only_and_remembers_them(tmp_path, run):
    async def body(psock, dsock, ports, events, proxy):
        replies = await dns(dsock, query("www.allowed.test"), query("other.test", qid=7),
                            query("allowed.test", np.QTYPE_AAAA), b"\x00\x09" + b"\0" * 10)
        # the answered address is now reachable by IP (a tool that resolves, then connects)
        via_ip = await request(psock, f"CONNECT 127.0.0.3:{ports['b']} HTTP/1.1\r\n\r\n".encode(), b"x\n")
        # an oversized message closes the connection
        reader, writer = await asyncio.open_unix_connection(dsock)
        writer.write(b"\xff\xff" + b"\0" * 100)
        closed = await reader.read()
        writer.close()
        return replies, via_ip, closed, events

    replies, via_ip, closed, events = run(with_proxy(tmp_path, ["allowed.test"], body))
    assert answers(replies[0]) == (0x1234, 0, ["127.0.0.3"])
    assert answers(replies[1]) == (7, np.RCODE_NXDOMAIN, [])
    assert answers(replies[2]) == (0x1234, 0, [])
    assert replies[3][3] & 0xF == np.RCODE_FORMERR
    assert via_ip.endswith(b"b got x\n")
    assert closed == b""
    assert [d for _, d in events] == ["other.test"]


def test_refusal_events_are_bounded(tmp_path, run):
    async def body(psock, dsock, ports, events, proxy):
        for _ in range(5):
            await request(psock, f"CONNECT 127.0.0.2:{ports['c']} HTTP/1.1\r\n\r\n".encode())
        return events, proxy.refusals

    events, refusals = run(with_proxy(tmp_path, ["127.0.0.1/32"], body, ProxyLimits(refusal_events_max=2)))
    assert refusals == 5 and len(events) == 3 and "further ones are only logged" in events[2][0]


def test_relay_program_splices_a_connection_to_the_socket(tmp_path):
    """QEMU runs the relay with the guest connection on stdin/stdout: a socketpair here."""
    path = str(tmp_path / "up.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    guest, qemu_end = socket.socketpair()
    cmd = np.relay_command(path)
    p = subprocess.Popen(cmd, shell=True, stdin=qemu_end, stdout=qemu_end, stderr=subprocess.PIPE)
    qemu_end.close()
    try:
        conn, _ = srv.accept()
        guest.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        conn.sendall(b"pong")
        assert guest.recv(4) == b"pong"
        guest.shutdown(socket.SHUT_WR)
        assert conn.recv(10) == b""  # the guest's half-close reaches the host
        conn.sendall(b"bye")
        conn.close()
        assert guest.recv(10) == b"bye"
        assert guest.recv(10) == b""
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        guest.close()
        srv.close()
    assert os.path.basename(np.RELAY) in cmd and sys.executable in cmd
