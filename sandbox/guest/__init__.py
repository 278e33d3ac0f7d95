"""What runs inside the guest VM: ``init.sh`` (PID 1) and ``shim.py`` (the command runner).

Both are copied into the guest's initramfs by :mod:`sandbox.vm.image`. Everything here
uses the Python standard library only — the guest has no third-party packages.
"""
