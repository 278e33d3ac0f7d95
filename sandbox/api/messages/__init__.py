"""Pydantic models of every API message: the one source of truth for STDIO and MCP (issue 14).

* :mod:`.bounds` — the named bounds of every field (PATH_CHARS_MAX, TEXT_CHARS_MAX…);
* :mod:`.fields` — base classes (:class:`~.fields.Closed` for what a client sends,
  :class:`~.fields.Open` for what the agent sends) and field types;
* :mod:`.shapes` — the shapes several messages share (diff path, restored path, directory
  entry, folder, mount, step, barrier…), each defined once;
* :mod:`.requests`, :mod:`.results`, :mod:`.events` — the STDIO payloads by type
  (:data:`~.requests.REQUESTS`, :data:`~.results.RESULTS`, :data:`~.events.EVENTS`);
* :mod:`.tools` — the MCP tool inputs and outputs, built from the shared shapes.

:mod:`sandbox.api.schema` generates the shipped STDIO JSON Schema from these models
(``python -m sandbox.api.schema --write``); the MCP server advertises their schemas in ``tools/list``.
"""
