"""External-modification detection: who else changed the working folder, and when.

* :mod:`.journal` — the own-write journal: a HostFS wrapper recording the sandbox's own
  writes, so the watcher can tell them from everybody else's;
* :mod:`.watch` — the inotify watcher that reports the rest (the session turns a report
  into an undo barrier, a warning, or both);
* :mod:`.lock` — the ``lock`` policy: a read-only bind mount of the folder for everyone
  but the sandbox.

It sits beside the undo core, not in it: the core only learns of a change through
:meth:`~sandbox.core.workspace.Workspace.record_external_modification`.
"""
