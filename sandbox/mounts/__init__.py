"""What the servers export: providers over host directories and in-memory trees.

* :class:`Provider` — one served tree (intercepted, read-only or in-memory);
* :func:`memory_tree` — seed 000's in-memory share from a ``{path: bytes}`` dict.

(The hold gate moved to :mod:`sandbox.serving`.)

The mount table of seed 004 (several exports at guest paths, restricted views) lives
here as it is built.
"""

from .memory import memory_tree
from .provider import Provider, child

__all__ = ["Provider", "memory_tree", "child"]
