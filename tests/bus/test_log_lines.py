"""Every log line leaves a process in one write, its newline included. A worker group's ranks share one
stderr pipe and the launcher's threads share its stderr; a pipe keeps a write of up to 4096 bytes whole,
so a line written in two parts (as print() does) could take another writer's line between them."""

from __future__ import annotations

import io
import logging
import sys

import structlog

from llmbus.bus.service import setup_logging
from llmbus.supervisor.launcher import write_line


class WriteRecorder(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def assert_whole_lines(writes: list[str], count: int) -> None:
    assert len(writes) == count, writes
    for text in writes:
        assert text.endswith("\n") and text.count("\n") == 1, writes


def test_structlog_and_library_lines_are_one_write_each(monkeypatch):
    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for json_output in (True, False):
            setup_logging("worker", rank=0, json_output=json_output)
            structlog.get_logger("llmbus.worker").info("shutdown", reason="test")
            logging.getLogger("a.library").warning("a library's warning")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    assert_whole_lines(recorder.writes, 4)
    assert '"event": "shutdown"' in recorder.writes[0] and "a library's warning" in recorder.writes[1]


def test_launcher_lines_are_one_write_each(monkeypatch):
    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    write_line('{"event": "ready", "service": "launcher"}')
    write_line("llmbus: a plain line")
    assert_whole_lines(recorder.writes, 2)
