"""The MCP server (issue 14)."""
