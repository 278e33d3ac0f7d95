"""STDIO JSON-Lines API, schemas and the error taxonomy."""
