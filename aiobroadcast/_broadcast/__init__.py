"""Broadcast: one writer, many readers over the shared-memory ring (and its TCP server).
The channel, the writer and reader roles, async and blocking, and their factories."""
