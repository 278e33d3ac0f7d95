"""What the page shows of commands no page ran: every command of the session, whoever runs it.

:func:`attach` makes ``agent``'s sessions (the one running now and every later one) tell the
hub of each command (``ui.command``: its text, the client that runs it — ``stdio`` for the
agent's own ``agent.execute``, the page's included, ``mcp`` for an LLM's ``execute_command``)
and of the output of commands the agent did not run itself (``ui.output``: an MCP client's;
the agent's own already reach the page as ``event.terminal_output``). A session tells its
listeners without blocking (:attr:`sandbox.session.runtime.Session.command_listeners`); the
hub only queues.
"""

from __future__ import annotations

from ...session.runtime import Session
from ..agent import Agent
from .hub import Hub


def attach(agent: Agent, hub: Hub) -> None:
    """Tap ``agent``'s current session, if any, and each one it starts or adopts later."""
    tapped: set[int] = set()

    def tap(session: Session) -> None:
        if id(session) in tapped:
            return
        tapped.add(id(session))

        def on_command(e: dict) -> None:
            client = agent.running_client() or "mcp"
            if e["type"] == "command":
                hub.publish({"type": "ui.command", "payload": {"command": e["command"], "step_id": e["step_id"],
                                                              "client": client}})
            elif client != "stdio":
                hub.publish({"type": "ui.output", "payload": {"stream": e["stream"], "data": e["data"],
                                                             "step_id": e["step_id"], "client": client}})

        session.command_listeners.append(on_command)
        hub.publish({"type": "ui.session", "payload": {"state": "started"}})

    agent.session_listeners.append(tap)
    if agent.session is not None and agent.session.running:
        tap(agent.session)
