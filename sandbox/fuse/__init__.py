"""FUSE: a sans-I/O codec (bytes in, typed requests out; replies to bytes) and its serving.

As for :mod:`sandbox.ninep`: ``abi``/``messages``/``codec`` know only bytes and import
nothing of ours but each other; the dispatcher maps requests onto the shared
:class:`~sandbox.mounts.Provider`; the transport (``/dev/fuse``) owns the descriptor.
"""

#: the virtio-fs device's ``direct_io`` modes (:class:`~.virtiofs.VirtioFsServer`, ``serve-virtiofs
#: --direct-io``, a session's ``virtiofs_direct_io``) — which opens skip the guest's page cache
#: (``FOPEN_DIRECT_IO``): "write-only" (the default: write-only opens of a file open nowhere else,
#: and every open beside them; shared maps work) or "all" (every open, as C virtiofsd
#: ``cache=none``: large reads skip the guest's copy, but Linux 6.1 guests refuse shared maps of
#: any file, ``ENODEV``, and each small ``read(2)`` is a request)
DIRECT_IO_MODES = ("write-only", "all")
