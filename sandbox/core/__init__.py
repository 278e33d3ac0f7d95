"""The undo core: pure logic over the narrow host-filesystem interface.

No asyncio, no sockets, no threads of its own. It sees the working folder and the undo
store only through two :class:`~sandbox.hostfs.HostFS` objects, so the simulation can
drive it and inject a fault at any host call.

The write-ahead rules (every module here keeps them; ``sandbox_sim/`` proves them):

1. **Preimage before mutation.** Before the first mutating touch of a path in a step,
   its preimage (bytes, type, 12 mode bits, mtime ns, xattrs, symlink target) is in
   ``wal/in_progress/`` of the undo store. Before any entry of a directory changes, that
   directory's metadata is there too. A record is written in one ``write`` and ends in a
   newline; a line without its newline is torn and means "the mutation never started".
2. **Intent before creation.** A path about to be created or renamed is journalled
   *before* the host call (``created``/``renamed``), so a crash right after the call
   still knows to undo it. A host call that fails voids its intent records.
3. **Undo is the journal in reverse.** Rolling back applies each record's inverse,
   newest first. Records are relative to the moment they were written, so renames of
   whole directories cost one record, not a copy of the subtree, and each directory's
   metadata is restored after every later change inside it was undone (which is the
   "two passes" rule of the design: entries first, then directory times, deepest first).
4. **Promotion is one atomic rename.** A finished step's WAL directory is renamed to
   ``steps/<seq>/``; nothing else makes a step permanent.
5. **In-progress is always rolled back, never replayed.** On open, ``wal/in_progress``
   is undone and discarded; ``wal/rollback`` (a rollback that was interrupted) is
   finished from its durable progress count; ``trash/`` (interrupted evictions) is
   emptied.
6. **Never clobber what we did not write.** A rollback first compares the current state
   of every path it would touch with the fingerprint its step left; any difference
   refuses the rollback unless forced.
7. **Nothing from the store is trusted unchecked.** Every journal line and store file
   is sealed with a checksum and schema-checked; every preimage carries the hash of the
   original bytes, checked before any of it reaches the working folder. A step that
   fails is refused by name (``CorruptStep``) before anything is touched; recovery
   restores what verifies and reports the rest (``docs/undo-store.md`` § Integrity).
"""
