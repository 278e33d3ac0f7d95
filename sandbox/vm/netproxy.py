"""The host-side egress proxy of a guest in ``allowlist`` network mode (SPEC §5).

In allowlist mode the guest runs with QEMU ``restrict=on``: it has no route out. Its only
egress is this proxy, reached through QEMU ``guestfwd`` forwards to host unix sockets
(see :func:`relay_command`):

* the **proxy socket** speaks HTTP/1.x as a forward proxy: ``CONNECT host:port`` (HTTPS
  and any TCP, also what the guest's transparent redirector sends) and plain-HTTP
  absolute-form requests (``GET http://host[:port]/path``);
* the **DNS socket** speaks DNS over TCP (RFC 1035 §4.2.2: a two-byte length, then the
  message) — the guest's stub on 127.0.0.1:53 forwards its UDP queries here.

Policy (:class:`AllowList`): a destination is allowed when its IP is in an allowed CIDR,
or its *name* is an allowed domain (exact, or a subdomain of one). A name is resolved
host-side and then connected to whatever it resolves to — names are allowed by name. DNS
answers only allowed names (others: NXDOMAIN); the addresses it hands out are remembered
(bounded, :attr:`ProxyLimits.dns_answers_remembered_max`) so a tool that resolves a name
and then connects to its IP (through the transparent redirector) is allowed too.

Every refusal is logged and reported through ``on_refused(message, destination)`` (the
session turns it into ``event.warning``), at most :attr:`ProxyLimits.refusal_events_max`
times; later ones are only logged.

Parsing is sans-I/O (:func:`parse_request_head`, :func:`parse_dns_query`,
:func:`dns_reply`); :class:`NetProxy` is a thin asyncio loop around it. Every buffer, count
and wait has a named limit in :class:`ProxyLimits` with a defined overflow behaviour.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import os
import re
import shlex
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable

log = logging.getLogger("sandbox.netproxy")

#: the guest-side ports (on QEMU's guestfwd address 10.0.2.100) of the proxy and of DNS
PROXY_PORT = 3128
DNS_PORT = 53
DOMAIN_RE = re.compile(r"(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*")
HOP_HEADERS = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive", b"te", b"trailer",
               b"upgrade", b"proxy-authenticate"}


@dataclass(frozen=True)
class ProxyLimits:
    request_head_bytes_max: int = 16384  # request line + headers; over it: 431, closed
    header_count_max: int = 100  # over it: 431, closed
    connections_max: int = 256  # open client connections (both sockets); over it: 503 / closed at once
    splice_chunk_bytes: int = 65536  # one read while relaying; writes wait for drain (transport high-water mark)
    head_timeout_s: float = 30.0  # a client that sends no complete head in time: 408, closed
    connect_timeout_s: float = 10.0  # resolving + connecting upstream; over it: 504
    dns_message_bytes_max: int = 4096  # a larger DNS-over-TCP message: the connection is closed
    dns_queries_per_connection_max: int = 1024  # then the connection is closed (the stub reconnects)
    dns_timeout_s: float = 5.0  # host-side resolution of one name; over it: SERVFAIL
    dns_answer_ttl_s: int = 60
    dns_addresses_per_answer_max: int = 16
    dns_answers_remembered_max: int = 4096  # IP -> allowed name, oldest forgotten first
    refusal_events_max: int = 1000  # refusals reported through on_refused; later ones are only logged


class ProtocolError(ValueError):
    """A request the proxy refuses to parse: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


# ---------------------------------------------------------------------------- the allowlist


def _domain(item: str) -> str | None:
    name = item.strip().lower().rstrip(".")
    if name.startswith("*."):
        name = name[2:]  # "*.example.org" means what "example.org" means: it and its subdomains
    return name if DOMAIN_RE.fullmatch(name) and not name.replace(".", "").isdigit() else None


@dataclass(frozen=True)
class AllowList:
    """Allowed IPv4 networks and domain names (each allows itself and its subdomains)."""

    cidrs: tuple[ipaddress.IPv4Network, ...] = ()
    domains: tuple[str, ...] = ()

    @classmethod
    def parse(cls, items: list[str]) -> AllowList:
        """From ``["10.0.0.0/8", "1.2.3.4", "example.org"]``; ValueError names a bad item."""
        cidrs, domains = [], []
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"not an IP address, CIDR or domain name: {item!r}")
            try:
                net = ipaddress.ip_network(item.strip(), strict=False)
            except ValueError:
                name = _domain(item)
                if name is None or "." not in name:
                    raise ValueError(f"not an IP address, CIDR or domain name: {item!r}") from None
                if name not in domains:
                    domains.append(name)
                continue
            if net.version != 4:
                raise ValueError(f"only IPv4 reaches the guest (QEMU user networking): {item!r}")
            if net not in cidrs:
                cidrs.append(net)
        return cls(tuple(cidrs), tuple(domains))

    def items(self) -> list[str]:
        """The normalised items (CIDRs first), as :meth:`parse` reads them back."""
        return [str(n) for n in self.cidrs] + list(self.domains)

    def allows_ip(self, ip: str) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return addr.version == 4 and any(addr in n for n in self.cidrs)

    def allows_name(self, name: str) -> bool:
        n = _domain(name)
        return n is not None and any(n == d or n.endswith("." + d) for d in self.domains)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------- HTTP (sans-I/O)


@dataclass(frozen=True)
class Request:
    method: str
    host: str  # lower-case name or IP literal (no brackets)
    port: int
    path: str  # origin-form for plain HTTP; "" for CONNECT
    version: str  # "HTTP/1.0" | "HTTP/1.1"
    headers: tuple[tuple[bytes, bytes], ...]


def _host_port(text: str, default_port: int | None) -> tuple[str, int]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise ProtocolError(400, f"no port in {text!r}")
        port = default_port
    else:
        if not port_text.isdigit() or not (1 <= int(port_text) <= 65535):
            raise ProtocolError(400, f"bad port in {text!r}")
        port = int(port_text)
    host = host.lower().rstrip(".")
    if not host or not (is_ip(host) or _domain(host) == host):
        raise ProtocolError(400, f"bad host in {text!r}")
    return host, port


def parse_request_head(head: bytes, limits: ProxyLimits = ProxyLimits()) -> Request:
    """One request head (through the blank line) → :class:`Request`; ProtocolError otherwise."""
    if len(head) > limits.request_head_bytes_max:
        raise ProtocolError(431, f"request head over {limits.request_head_bytes_max} bytes")
    lines = head.split(b"\r\n")
    if len(lines) < 3 or lines[-1] != b"" or lines[-2] != b"":
        raise ProtocolError(400, "the head does not end with an empty line")
    lines = lines[:-2]
    if len(lines) - 1 > limits.header_count_max:
        raise ProtocolError(431, f"more than {limits.header_count_max} headers")
    try:
        method, target, version = lines[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(400, "bad request line") from None
    if version not in ("HTTP/1.0", "HTTP/1.1") or not method.isalpha() or not method.isupper():
        raise ProtocolError(400, f"bad request line {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or any(c in name for c in b" \t"):
            raise ProtocolError(400, f"bad header line {line[:80]!r}")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        host, port = _host_port(target, None)
        return Request(method, host, port, "", version, tuple(headers))
    m = re.fullmatch(r"http://([^/?#]+)([^#]*)", target, re.IGNORECASE)
    if m is None:
        raise ProtocolError(400, f"a proxy request needs an absolute http:// URL, not {target[:80]!r}")
    host, port = _host_port(m.group(1), 80)
    return Request(method, host, port, m.group(2) or "/", version, tuple(headers))


def origin_head(req: Request) -> bytes:
    """The head sent upstream for a plain-HTTP request: origin-form, hop-by-hop headers
    dropped, ``Connection: close`` (one request per upstream connection: whatever else the
    client sends on it can only reach the same allowed destination)."""
    out = [f"{req.method} {req.path} {req.version}".encode()]
    out += [n + b": " + v for n, v in req.headers if n.lower() not in HOP_HEADERS]
    out.append(b"Connection: close")
    return b"\r\n".join(out) + b"\r\n\r\n"


def http_error(status: int, message: str) -> bytes:
    reasons = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 431: "Request Header Fields Too Large",
               502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
    body = f"sandbox network allowlist: {message}\n".encode()
    return (f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# ---------------------------------------------------------------------------- DNS (sans-I/O)

QTYPE_A, QTYPE_AAAA, QCLASS_IN = 1, 28, 1
RCODE_OK, RCODE_FORMERR, RCODE_SERVFAIL, RCODE_NXDOMAIN, RCODE_NOTIMP, RCODE_REFUSED = 0, 1, 2, 3, 4, 5


class DnsError(ValueError):
    """A DNS message that is not one standard query (answered FORMERR when it has a header)."""


@dataclass(frozen=True)
class DnsQuery:
    id: int
    flags: int
    name: str  # lower-case, no trailing dot
    qtype: int
    qclass: int
    question: bytes  # the question section as received (echoed in the reply)


def parse_dns_query(msg: bytes) -> DnsQuery:
    """A standard query with exactly one question, no compression in it; DnsError otherwise."""
    if len(msg) < 12:
        raise DnsError("shorter than a DNS header")
    qid, flags, qd, _an, _ns, _ar = struct.unpack("!6H", msg[:12])
    if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qd != 1:
        raise DnsError("not a standard query with one question")
    pos, labels = 12, []
    while True:
        if pos >= len(msg):
            raise DnsError("truncated name")
        n = msg[pos]
        pos += 1
        if n == 0:
            break
        if n > 63:
            raise DnsError("a compressed or oversized label in the question")
        label = msg[pos:pos + n]
        if len(label) != n:
            raise DnsError("truncated label")
        labels.append(label)
        pos += n
        if pos - 12 > 255:
            raise DnsError("name over 255 bytes")
    if pos + 4 > len(msg):
        raise DnsError("truncated question")
    qtype, qclass = struct.unpack("!2H", msg[pos:pos + 4])
    try:
        name = b".".join(labels).decode("ascii").lower()
    except UnicodeDecodeError:
        raise DnsError("a non-ASCII name") from None
    return DnsQuery(qid, flags, name, qtype, qclass, msg[12:pos + 4])


def dns_reply(q: DnsQuery, rcode: int, addresses: list[str] = (), ttl_s: int = 60) -> bytes:
    """The answer to ``q``: ``rcode`` and one A record per IPv4 address (name by pointer)."""
    flags = 0x8000 | (q.flags & 0x0100) | 0x0080 | (rcode & 0xF)  # QR, RD echoed, RA
    answers = b"".join(struct.pack("!HHHIH", 0xC00C, QTYPE_A, QCLASS_IN, ttl_s, 4) + socket.inet_aton(a)
                       for a in addresses)
    return struct.pack("!6H", q.id, flags, 1, len(addresses), 0, 0) + q.question + answers


def dns_formerr(msg: bytes) -> bytes | None:
    """FORMERR for a message with at least a header, else None (nothing to answer)."""
    if len(msg) < 12:
        return None
    return struct.pack("!6H", struct.unpack("!H", msg[:2])[0], 0x8081, 0, 0, 0, 0)


# ---------------------------------------------------------------------------- the proxy

Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve_host(name: str) -> list[str]:
    """The host's own resolution of ``name`` (IPv4 only; the guest has no IPv6)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


class NetProxy:
    """The proxy and DNS endpoints of one guest (see the module docstring).

    ``resolve`` maps a name to IPv4 addresses host-side (default: :func:`resolve_host`);
    ``on_refused(message, destination)`` hears each refusal (called on the loop); ``dial``
    maps an allowed (address, port) to where it is actually connected (default: itself —
    tests map TEST-NET addresses onto this machine's loopback)."""

    def __init__(self, allow: AllowList, *, resolve: Resolver | None = None,
                 on_refused: Callable[[str, str], None] | None = None, limits: ProxyLimits = ProxyLimits(),
                 dial: Callable[[str, int], tuple[str, int]] | None = None):
        self.allow = allow
        self.dial = dial or (lambda addr, port: (addr, port))
        self.resolve = resolve or resolve_host
        self.on_refused = on_refused
        self.limits = limits
        self.refusals = 0
        self.connections = 0
        self._answered: collections.OrderedDict[str, str] = collections.OrderedDict()  # IP -> allowed name
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, proxy_path: str, dns_path: str) -> None:
        """Listen on two unix sockets (created 0600 — only QEMU, as this user, connects)."""
        for path, handler in ((proxy_path, self._proxy_client), (dns_path, self._dns_client)):
            if os.path.exists(path):
                os.unlink(path)
            old = os.umask(0o177)
            try:
                server = await asyncio.start_unix_server(self._guarded(handler), path,
                                                         limit=self.limits.request_head_bytes_max)
            finally:
                os.umask(old)
            self._servers.append(server)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    def _guarded(self, handler):
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if self.connections >= self.limits.connections_max:
                log.warning("netproxy: %d connections open (connections_max): one refused", self.connections)
                if handler == self._proxy_client:
                    writer.write(http_error(503, f"more than {self.limits.connections_max} connections"))
                await _close(writer)
                return
            self.connections += 1
            self._tasks.add(task)
            try:
                await handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            except Exception:  # a bug must not take the proxy down: this connection ends, others go on
                log.exception("netproxy: connection failed")
            finally:
                self.connections -= 1
                self._tasks.discard(task)
                await _close(writer)

        return run

    def _refused(self, message: str, destination: str) -> None:
        self.refusals += 1
        log.warning("netproxy: refused %s: %s", destination, message)
        if self.on_refused is None:
            return
        if self.refusals <= self.limits.refusal_events_max:
            self.on_refused(f"network allowlist: refused {destination}: {message}", destination)
        elif self.refusals == self.limits.refusal_events_max + 1:
            self.on_refused(f"network allowlist: more than {self.limits.refusal_events_max} refusals; "
                            "further ones are only logged", destination)

    # ------------------------------------------------------------------ policy

    def _remember(self, name: str, addresses: list[str]) -> None:
        for a in addresses:
            self._answered.pop(a, None)
            self._answered[a] = name
        while len(self._answered) > self.limits.dns_answers_remembered_max:
            self._answered.popitem(last=False)

    def decide(self, host: str) -> str | None:
        """Why ``host`` (a name or an IP literal) is refused, or None when it is allowed."""
        if is_ip(host):
            if self.allow.allows_ip(host) or host in self._answered:
                return None
            return "the address is not in an allowed network"
        if self.allow.allows_name(host):
            return None
        return "the name is not an allowed domain"

    async def _addresses(self, host: str) -> list[str]:
        if is_ip(host):
            return [host]
        addrs = await asyncio.wait_for(self.resolve(host), self.limits.connect_timeout_s)
        return [a for a in addrs if is_ip(a) and ipaddress.ip_address(a).version == 4]

    async def _connect(self, host: str, port: int):
        async def go():
            last: Exception | None = None
            for addr in await self._addresses(host):
                try:
                    return await asyncio.open_connection(*self.dial(addr, port), limit=self.limits.splice_chunk_bytes)
                except OSError as e:
                    last = e
            raise last or OSError(f"{host} has no IPv4 address")

        return await asyncio.wait_for(go(), self.limits.connect_timeout_s)

    # ------------------------------------------------------------------ HTTP proxy

    async def _proxy_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.head_timeout_s)
            req = parse_request_head(head, self.limits)
        except asyncio.LimitOverrunError:
            writer.write(http_error(431, f"request head over {self.limits.request_head_bytes_max} bytes"))
            return
        except asyncio.TimeoutError:
            writer.write(http_error(408, "no complete request head in time"))
            return
        except ProtocolError as e:
            writer.write(http_error(e.status, str(e)))
            return
        dest = f"{req.host}:{req.port}"
        why = self.decide(req.host)
        if why is not None:
            self._refused(why, dest)
            writer.write(http_error(403, f"{dest}: {why}"))
            return
        try:
            up_reader, up_writer = await self._connect(req.host, req.port)
        except asyncio.TimeoutError:
            writer.write(http_error(504, f"{dest}: no connection within {self.limits.connect_timeout_s:g} s"))
            return
        except OSError as e:
            writer.write(http_error(502, f"{dest}: {e.strerror or e}"))
            return
        try:
            if req.method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up_writer.write(origin_head(req))
            await writer.drain()
            await self._splice(reader, writer, up_reader, up_writer)
        finally:
            await _close(up_writer)

    async def _splice(self, r1, w1, r2, w2) -> None:
        """Relay both ways until both sides have ended; at most ``splice_chunk_bytes`` in
        hand per direction (a write waits for the peer to drain)."""
        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(self.limits.splice_chunk_bytes):
                    w.write(data)
                    await w.drain()
                if w.can_write_eof():
                    w.write_eof()
            except (ConnectionError, OSError):
                w.close()

        await asyncio.gather(pump(r1, w2), pump(r2, w1))

    # ------------------------------------------------------------------ DNS over TCP

    async def answer(self, msg: bytes) -> bytes | None:
        """The reply to one DNS message (None: nothing can be answered)."""
        try:
            q = parse_dns_query(msg)
        except DnsError:
            return dns_formerr(msg)
        if q.qclass != QCLASS_IN:
            return dns_reply(q, RCODE_NOTIMP)
        if not self.allow.allows_name(q.name):
            self._refused("the name is not an allowed domain (DNS: NXDOMAIN)", q.name)
            return dns_reply(q, RCODE_NXDOMAIN)
        if q.qtype != QTYPE_A:
            return dns_reply(q, RCODE_OK)  # no IPv6 in the guest; nothing else is served
        try:
            addrs = await asyncio.wait_for(self.resolve(q.name), self.limits.dns_timeout_s)
        except asyncio.TimeoutError:
            return dns_reply(q, RCODE_SERVFAIL)
        except OSError:
            return dns_reply(q, RCODE_NXDOMAIN)
        addrs = [a for a in addrs if is_ip(a) and ipaddress.ip_address(a).version == 4]
        addrs = addrs[:self.limits.dns_addresses_per_answer_max]
        self._remember(q.name, addrs)
        return dns_reply(q, RCODE_OK, addrs, self.limits.dns_answer_ttl_s)

    async def _dns_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(self.limits.dns_queries_per_connection_max):
            try:
                (n,) = struct.unpack("!H", await reader.readexactly(2))
            except asyncio.IncompleteReadError:
                return
            if n > self.limits.dns_message_bytes_max:
                log.warning("netproxy: a %d-byte DNS message (dns_message_bytes_max %d): connection closed",
                            n, self.limits.dns_message_bytes_max)
                return
            reply = await self.answer(await reader.readexactly(n))
            if reply is None:
                return
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


# ---------------------------------------------------------------------------- the QEMU side

RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netrelay.py")


def relay_command(socket_path: str, python: str = sys.executable) -> str:
    """The ``guestfwd=…-cmd:`` program for one forward: QEMU spawns it for *each* guest
    connection (a ``-unix:`` chardev forward would carry every guest connection on one
    host connection, interleaved), stdin/stdout being the connection; it relays to
    ``socket_path``. A shell-quoted string (QEMU splits it with g_shell_parse_argv)."""
    return " ".join(shlex.quote(a) for a in (python, "-I", "-S", RELAY, socket_path))
