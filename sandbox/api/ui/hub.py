"""The page's event fan-out: every event of the session to every connected page, bounded.

:class:`Hub` lives on the web server's event loop; :meth:`Hub.publish` may be called from
any thread (the agent's ``emit``: the undo core, the guest's I/O thread, request threads).

Bounds (docs/ui.md quotes them):

* ``CLIENTS_MAX`` pages connected at once; one more is told why and closed
  (``CLOSE_TOO_MANY``) — the others are untouched;
* ``CLIENT_QUEUE_MAX`` messages waiting for one page; a page that falls that far behind is
  closed (``CLOSE_TOO_SLOW``) rather than making the session wait or memory grow: the
  page reconnects and gets the backlog;
* the backlog for reconnects keeps the newest ``BACKLOG_MESSAGES_MAX`` events and at most
  ``BACKLOG_CHARS_MAX`` characters of them (encoded JSON); older ones are dropped first and
  counted (``dropped`` in the welcome), so a page knows its history is partial.

Invariants: a page receives events in publication order; its backlog replay comes before
any live event (joining happens on the loop, between two deliveries); publishing never
blocks.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading

#: pages connected at once (one more: closed with CLOSE_TOO_MANY)
CLIENTS_MAX = 8
#: messages queued for one page (one more: the page is closed with CLOSE_TOO_SLOW)
CLIENT_QUEUE_MAX = 4096
#: events kept for a page that (re)connects
BACKLOG_MESSAGES_MAX = 2000
#: characters (encoded JSON) of those events at most
BACKLOG_CHARS_MAX = 2 << 20
#: WebSocket close codes (RFC 6455 §7.4: 1008 policy violation, 1013 try again later)
CLOSE_TOO_MANY = 1013
CLOSE_TOO_SLOW = 1013


def encode(message: dict) -> str:
    return json.dumps(message, separators=(",", ":"))


class Client:
    """One connected page: its queue of encoded messages, and why it was cut off (if it was)."""

    def __init__(self, queue_max: int):
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(queue_max)
        self.closed_reason: str | None = None

    def put(self, text: str) -> bool:
        """Queue ``text``; False (and the page marked to close) if its queue is full."""
        if self.closed_reason is not None:
            return False
        try:
            self.queue.put_nowait(text)
            return True
        except asyncio.QueueFull:
            self.closed_reason = f"more than {self.queue.maxsize} messages were waiting for this page"
            _drain_then_stop(self.queue)
            return False


def _drain_then_stop(q: asyncio.Queue) -> None:
    """Empty ``q`` and leave None in it: the page's sender stops and closes the socket."""
    while not q.empty():
        q.get_nowait()
    q.put_nowait(None)


class Hub:
    def __init__(self, *, clients_max: int = CLIENTS_MAX, queue_max: int = CLIENT_QUEUE_MAX,
                 backlog_max: int = BACKLOG_MESSAGES_MAX, backlog_chars_max: int = BACKLOG_CHARS_MAX):
        self.clients_max = clients_max
        self.queue_max = queue_max
        self.backlog_chars_max = backlog_chars_max
        self.clients: set[Client] = set()
        self._backlog: collections.deque[str] = collections.deque()
        self._backlog_max = backlog_max
        self._backlog_chars = 0
        self.dropped = 0  # events dropped from the backlog since the start
        self._lock = threading.Lock()  # the backlog (publish from any thread before the loop runs)
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop deliveries run on (the web server's); until then events only enter the backlog."""
        self._loop = loop

    def publish(self, message: dict) -> None:
        """An event for every page (any thread; never blocks)."""
        text = encode(message)
        loop = self._loop
        if loop is None or loop.is_closed():
            self._remember(text)
            return
        try:
            loop.call_soon_threadsafe(self._deliver, text)
        except RuntimeError:  # the loop closed meanwhile
            self._remember(text)

    def _remember(self, text: str) -> None:
        with self._lock:
            self._backlog.append(text)
            self._backlog_chars += len(text)
            while self._backlog and (len(self._backlog) > self._backlog_max
                                     or self._backlog_chars > self.backlog_chars_max):
                self._backlog_chars -= len(self._backlog.popleft())
                self.dropped += 1

    def _deliver(self, text: str) -> None:
        self._remember(text)
        for c in list(self.clients):
            c.put(text)

    def join(self) -> tuple[Client, list[str], int] | None:
        """A new page (on the loop): its client, the backlog to replay first, and how many
        events the backlog has dropped — or None when ``clients_max`` pages are connected."""
        if len(self.clients) >= self.clients_max:
            return None
        c = Client(self.queue_max)
        self.clients.add(c)
        with self._lock:
            return c, list(self._backlog), self.dropped

    def leave(self, client: Client) -> None:
        self.clients.discard(client)
