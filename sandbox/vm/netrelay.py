"""Relay one guest connection to a host unix socket (stdlib only; run by QEMU).

QEMU's ``guestfwd=tcp:ADDR:PORT-cmd:…`` spawns this program once per guest TCP connection
with the connection on stdin/stdout (a socket). It connects to the unix socket named by
its one argument and copies bytes both ways, half-closing each direction when its source
ends, and exits when both have ended. At most ``CHUNK_BYTES`` are in hand at a time.
It exits on its own when QEMU goes (its stdin ends).
"""

import os
import select
import socket
import sys

CHUNK_BYTES = 65536


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: netrelay.py UNIX_SOCKET", file=sys.stderr)
        return 2
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(argv[1])
    except OSError as e:
        print(f"netrelay: {argv[1]}: {e.strerror}", file=sys.stderr)
        return 1
    guest_in, guest_out = 0, 1
    open_dirs = {guest_in: up.fileno(), up.fileno(): guest_out}
    while open_dirs:
        ready, _, _ = select.select(list(open_dirs), [], [])
        for src in ready:
            try:
                data = os.read(src, CHUNK_BYTES)
            except OSError:
                data = b""
            dst = open_dirs[src]
            if not data:
                del open_dirs[src]
                try:  # a dup: closing the wrapper leaves ``dst`` itself open
                    with socket.socket(fileno=os.dup(dst)) as half:
                        half.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                continue
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(dst, view):]
            except OSError:
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
