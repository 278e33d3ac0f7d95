"""The serving machinery every protocol server shares (9P today; FUSE and virtio-fs next).

* :class:`HoldBroker` — one per session: pending safeguard holds, answers, the one deadline;
  servers, the STDIO agent, the SDK (and MCP) subscribe and answer through it;
* :class:`HoldGate` — per intercepted export: mutations wait, in order, behind a hold;
* :class:`Export` — a provider as served: the handle registry (handles follow renames),
  its gate and its lock table;
* :class:`RequestPipeline` — per connection: a request runs at once or waits as a task
  behind its export's gate; cancel = ``Tflush`` / FUSE ``INTERRUPT``.

A protocol keeps its framing, its message table (which requests are mutations) and its
flush/interrupt semantics; nothing here knows a wire format.
"""

from .exports import Export
from .holds import HoldBroker, HoldGate
from .locks import LockTable
from .pipeline import RequestPipeline

__all__ = ["Export", "HoldBroker", "HoldGate", "LockTable", "RequestPipeline"]
