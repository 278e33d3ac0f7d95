"""The VM side of a session, seen from the host: guest image, QEMU command line, (later)
KVM probe, QMP and the control channel (SPEC §5)."""
