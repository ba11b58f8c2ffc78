"""Fan-in: many senders, one collector (docs/fan-in.md). Built on the broadcast family."""
