"""The local guest (issue 16): commands on the host against FUSE mounts of the session's shares.

:mod:`.guest` (:class:`~sandbox.local.guest.LocalGuest`, ``guest="local"``) and :mod:`.holder`
(the namespace holder it starts). Undo, not isolation: docs/fuse.md "Local guest".
"""
