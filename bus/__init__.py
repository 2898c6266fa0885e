"""The message bus: every cross-process message, sockets, run dir."""
