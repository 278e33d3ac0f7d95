"""Sessions: a guest running commands on the user's folders, every write undoable."""
