"""The network allowlist in a real guest: the host proxy is its only way out.

Upstream servers listen on THIS machine's loopback only: A on 127.0.0.1 (allowed by IP),
B on 127.0.0.3 (allowed by the name ``allowed.test``), C on 127.0.0.2 (not listed, also
named ``blocked.test``). The guest sees them as TEST-NET-1 addresses 192.0.2.N; the proxy's
``dial`` maps an allowed 192.0.2.N onto 127.0.0.N and refuses to dial anything else, so
nothing but loopback is ever contacted.
"""

from __future__ import annotations

import http.server
import ipaddress
import threading

import pytest

from sandbox.session.runtime import Folder, Session
from sandbox.vm.guest import VmGuest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # the allowlist is threat-model evidence: in the default run

NAMES = {"allowed.test": ["192.0.2.3"], "blocked.test": ["192.0.2.2"]}


async def resolve(name: str) -> list[str]:
    if name not in NAMES:
        raise OSError(f"{name}: not in the test's names")
    return NAMES[name]


def dial(addr: str, port: int) -> tuple[str, int]:
    ip = ipaddress.ip_address(addr)
    if ip not in ipaddress.ip_network("192.0.2.0/24"):
        raise OSError(f"the test dials only 192.0.2.0/24 (onto loopback), not {addr}")
    return f"127.0.0.{int(ip) & 0xFF}", port


class Server:
    def __init__(self, name: str, host: str):
        self.hits = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits += 1
                body = f"server-{name}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


PY_PROBE = r"""python3 - <<'EOF'
import socket
def get(host, port):
    try:
        s = socket.create_connection((host, port), timeout=8)
        s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        s.settimeout(8)
        chunks = []
        while True:  # to EOF: the reply may arrive in several segments through the relays
            chunk = s.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks).decode(errors="replace")
        return "server-" + data.split("server-", 1)[1].strip() if "server-" in data else "nothing"
    except OSError as e:
        return "failed " + type(e).__name__
for name in ("allowed.test", "blocked.test"):
    try:
        print("dns", name, socket.gethostbyname(name))
    except OSError as e:
        print("dns", name, "failed")
print("raw A", get("192.0.2.1", PA))
print("raw B", get("192.0.2.3", PB))
print("raw C", get("192.0.2.2", PC))
print("host C", get("10.0.2.2", PC))
EOF"""


def test_allowlist_reaches_only_the_allowed_even_for_guest_root(vm_guest, tmp_path):
    project = tmp_path / "p"
    project.mkdir()
    servers = {"A": Server("A", "127.0.0.1"), "C": Server("C", "127.0.0.2"), "B": Server("B", "127.0.0.3")}
    pa, pb, pc = servers["A"].port, servers["B"].port, servers["C"].port
    events = []
    try:
        s = Session([Folder(str(project))], network="allowlist", allow=["192.0.2.1", "allowed.test"],
                    on_event=events.append,
                    guest=lambda run_dir: VmGuest(run_dir=run_dir, network="allowlist", allow=s.allow, as_root=True,
                                                  on_refused=s._net_refused, net_resolve=resolve, net_dial=dial))
        with s:
            def run(cmd):
                out = []
                r = s.run(cmd, lambda stream, text: out.append(text))
                return r.exit_code, "".join(out)

            # tools that honour HTTP_PROXY: curl
            _, a = run(f"curl -sS -m 30 http://192.0.2.1:{pa}/")
            _, b = run(f"curl -sS -m 30 http://allowed.test:{pb}/")
            _, c_ip = run(f"curl -sS -m 30 http://192.0.2.2:{pc}/")
            _, c_name = run(f"curl -sS -m 30 http://blocked.test:{pc}/")
            # tools that ignore it: DNS through the stub, TCP through the transparent redirector
            probe = PY_PROBE.replace("PA", str(pa)).replace("PB", str(pb)).replace("PC", str(pc))
            _, plain = run(probe)
            # guest root widens nothing: no firewall, a default route, a raw socket
            _, flushed = run("echo uid=$(id -u); nft flush ruleset; ip route replace default via 10.0.2.2 dev eth0; " + probe)
            # the DNS stub killed by guest root comes back (init respawns it): a condition wait, ≤ 30 s
            _, respawn = run("n=0; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '[n]etstub.py' "
                             "&& kill -9 ${p#/proc/} && n=$((n+1)); done; echo killed $n; for i in $(seq 60); do python3 -c \"import socket; "
                             "print('dns again', socket.gethostbyname('allowed.test'))\" 2>/dev/null && break; "
                             "sleep 0.5; done")
            _, raw = run("python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_RAW, "
                         "socket.IPPROTO_TCP); s.sendto(bytes(40), (\"192.0.2.2\", 0)); print(\"raw sent\")'")
    finally:
        for srv in servers.values():
            srv.close()
    assert "server-A" in a, a
    assert "server-B" in b, b
    assert "403" in c_ip or "allowlist" in c_ip, c_ip
    assert "allowlist" in c_name, c_name
    assert "dns allowed.test 192.0.2.3" in plain and "dns blocked.test failed" in plain, plain
    assert "raw A server-A" in plain and "raw B server-B" in plain, plain
    assert "raw C server-C" not in plain and "host C server-C" not in plain, plain
    assert "uid=0" in flushed, flushed  # the widening attempts ran as guest root
    assert "server-C" not in flushed and "dns blocked.test failed" in flushed, flushed
    assert "killed 1" in respawn and "dns again 192.0.2.3" in respawn, respawn
    assert servers["C"].hits == 0  # nothing ever reached the non-listed server
    warnings = [e for e in events if e.get("type") == "event.warning"]
    assert any("192.0.2.2" in e["message"] for e in warnings), warnings
    assert any("blocked.test" in e["message"] for e in warnings), warnings
    del raw
