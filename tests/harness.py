"""Kept while the test files move to importing ``llmbus.testing`` directly: the same names, from there."""

from llmbus.bus.procfs import command_line as cmdline
from llmbus.bus.procfs import descendants
from llmbus.testing.server import LineReader, Server, free_port, rank_pids
from llmbus.testing.supervisor_socket import SupervisorSocket

__all__ = ["LineReader", "Server", "SupervisorSocket", "cmdline", "descendants", "free_port", "rank_pids"]
