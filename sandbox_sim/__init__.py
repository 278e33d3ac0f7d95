"""The simulation framework: prove the undo core against a simulated disk.

* :mod:`sandbox_sim.oracle` — byte-exact tree snapshots (type, bytes, 12 mode bits, mtime ns,
  xattrs, symlink targets) and readable diffs.
* :mod:`sandbox_sim.faults` — a fault injector: crash at the k-th host call, torn writes,
  ENOSPC/EIO from undo-store writes.
* :mod:`sandbox_sim.client` — a simulated filesystem client issuing the primitive sequences a
  guest kernel would (create+write, O_TRUNC rewrite, temp-then-rename, ``rm -rf`` …).
* :mod:`sandbox_sim.world` — a working folder + undo store pair (simulated, or a real temp dir)
  that can be "crashed" and reopened.
* ``python -m sandbox_sim run`` — the campaign runner (see ``sandbox_sim/__main__.py``).
"""
