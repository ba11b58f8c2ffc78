"""The shared-memory layer: layout, segment and liveness, wake-ups, publisher, subscriber."""
