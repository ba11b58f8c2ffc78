"""Calls: request/reply over a pool of workers (docs/fan-in.md, "Calls"). Built on
broadcast and fan-in."""
