"""The MCP server (issue 14): a stock MCP client drives a sandbox session through tools.

* :mod:`.host` — what a server instance acts on (:class:`~.host.McpHost`): its own session
  (``sandbox mcp``) or a shared one (the socket/HTTP transports);
* :mod:`.server` — the SDK server object and the transports' entry points
  (:func:`~.server.build_server`, :func:`~.server.serve_streams`, :func:`~.server.serve_stdio`);
* :mod:`.models` — pydantic models of every tool's input and output (the schemas the
  client sees); :mod:`.tools` — the tool table (names, annotations); :mod:`.client` — one
  connection's state and the tools' implementations; :mod:`.limits` — the named limits.
"""
