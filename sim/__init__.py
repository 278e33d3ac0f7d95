"""The simulation framework: prove the undo core against a simulated disk.

* :mod:`sim.oracle` — byte-exact tree snapshots (type, bytes, 12 mode bits, mtime ns,
  xattrs, symlink targets) and readable diffs.
* :mod:`sim.faults` — a fault injector: crash at the k-th host call, torn writes,
  ENOSPC/EIO from undo-store writes.
* :mod:`sim.client` — a simulated filesystem client issuing the primitive sequences a
  guest kernel would (create+write, O_TRUNC rewrite, temp-then-rename, ``rm -rf`` …).
* :mod:`sim.world` — a working folder + undo store pair (simulated, or a real temp dir)
  that can be "crashed" and reopened.
* ``python -m sim run`` — the campaign runner (see ``sim/__main__.py``).
"""
