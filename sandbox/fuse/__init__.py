"""FUSE: a sans-I/O codec (bytes in, typed requests out; replies to bytes) and its serving.

As for :mod:`sandbox.ninep`: ``abi``/``messages``/``codec`` know only bytes and import
nothing of ours but each other; the dispatcher maps requests onto the shared
:class:`~sandbox.mounts.Provider`; the transport (``/dev/fuse``) owns the descriptor.
"""
