#!/usr/bin/env python3
"""The guest side of the network allowlist (stdlib only; started by init.sh as root).

In allowlist mode the guest has no route out (QEMU ``restrict=on``); the host's proxy
(sandbox/vm/netproxy.py) on 10.0.2.100 is its only egress and enforces the list. This
program only adapts guest traffic to it — it enforces nothing, so guest root killing or
replacing it widens nothing:

* **DNS stub** on 127.0.0.1:53 (UDP and TCP): each query is forwarded over TCP to
  10.0.2.100:53 (QEMU forwards only TCP) and the answer returned;
* **transparent redirector** on 127.0.0.1:REDIR_PORT: init.sh's nftables rule redirects
  every other outgoing TCP connection here; it reads the original destination
  (``SO_ORIGINAL_DST``) and asks the proxy for it with ``CONNECT ip:port``.

Limits: ``CONNECTIONS_MAX`` concurrent connections (more are closed at once),
``DNS_MESSAGE_BYTES_MAX`` per message, ``CHUNK_BYTES`` in hand per direction,
``TIMEOUT_S`` per upstream connect / answer.
"""

import os
import select
import socket
import struct
import sys
import threading

PROXY = ("10.0.2.100", 3128)
DNS = ("10.0.2.100", 53)
REDIR_PORT = 3129
SO_ORIGINAL_DST = 80
CONNECTIONS_MAX = 256
DNS_MESSAGE_BYTES_MAX = 4096
HEAD_BYTES_MAX = 4096
CHUNK_BYTES = 65536
TIMEOUT_S = 15.0

slots = threading.BoundedSemaphore(CONNECTIONS_MAX)


def log(msg):
    print(f"sandbox-netstub: {msg}", file=sys.stderr, flush=True)


def recv_exactly(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def ask_dns(query):
    with socket.create_connection(DNS, timeout=TIMEOUT_S) as s:
        s.sendall(struct.pack("!H", len(query)) + query)
        (n,) = struct.unpack("!H", recv_exactly(s, 2))
        if n > DNS_MESSAGE_BYTES_MAX:
            raise ConnectionError("oversized answer")
        return recv_exactly(s, n)


def serve_dns_udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("127.0.0.1", 53))
    while True:
        query, peer = u.recvfrom(DNS_MESSAGE_BYTES_MAX)
        if not slots.acquire(blocking=False):
            continue  # dropped: the client retries

        def answer(query=query, peer=peer):
            try:
                u.sendto(ask_dns(query), peer)
            except OSError as e:
                log(f"dns: {e}")
            finally:
                slots.release()

        threading.Thread(target=answer, daemon=True).start()


def splice(a, b):
    """Copy both ways until both directions have ended."""
    open_dirs = {a: b, b: a}
    while open_dirs:
        ready, _, _ = select.select(list(open_dirs), [], [])
        for src in ready:
            try:
                data = src.recv(CHUNK_BYTES)
            except OSError:
                data = b""
            dst = open_dirs[src]
            if not data:
                del open_dirs[src]
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                continue
            try:
                dst.sendall(data)
            except OSError:
                return


def serve_dns_tcp_client(c):
    with c:
        c.settimeout(TIMEOUT_S)
        (n,) = struct.unpack("!H", recv_exactly(c, 2))
        if n > DNS_MESSAGE_BYTES_MAX:
            return
        reply = ask_dns(recv_exactly(c, n))
        c.sendall(struct.pack("!H", len(reply)) + reply)


def redirect_client(c):
    with c:
        raw = c.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, addr = struct.unpack("!H", raw[2:4])[0], socket.inet_ntoa(raw[4:8])
        with socket.create_connection(PROXY, timeout=TIMEOUT_S) as up:
            up.sendall(f"CONNECT {addr}:{port} HTTP/1.1\r\nHost: {addr}:{port}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = up.recv(HEAD_BYTES_MAX)
                if not chunk or len(head) + len(chunk) > HEAD_BYTES_MAX:
                    return
                head += chunk
            if not head.startswith(b"HTTP/1.1 200"):
                log(f"{addr}:{port}: {head.splitlines()[0].decode(errors='replace')}")
                return  # closed: the client sees its connection end (the proxy logged the refusal)
            up.settimeout(None)
            c.settimeout(None)
            rest = head.split(b"\r\n\r\n", 1)[1]
            if rest:
                c.sendall(rest)
            splice(c, up)


def serve_tcp(port, handler):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        if not slots.acquire(blocking=False):
            c.close()  # over CONNECTIONS_MAX
            continue

        def run(c=c):
            try:
                handler(c)
            except (OSError, ConnectionError, struct.error) as e:
                log(f"{handler.__name__}: {e}")
            finally:
                slots.release()

        threading.Thread(target=run, daemon=True).start()


def main():
    for target in (serve_dns_udp, lambda: serve_tcp(53, serve_dns_tcp_client),
                   lambda: serve_tcp(REDIR_PORT, redirect_client)):
        threading.Thread(target=target, daemon=True).start()
    log(f"up (pid {os.getpid()}): DNS on 127.0.0.1:53, redirector on 127.0.0.1:{REDIR_PORT}")
    threading.Event().wait()


if __name__ == "__main__":
    main()
