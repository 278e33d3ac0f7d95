"""The scripted guest: a documented stand-in for the VM, for frontend development and tests.

It speaks real 9P2000.L to the session's real server and runs commands written in a
tiny shell-like language, so everything on the host side is exercised without QEMU.
"""
