"""``sandbox ui``: a local web page over a session (issue 18) — see docs/ui.md."""
