"""What Linux's /proc says about processes and the host, read in one place for every service, test and
benchmark: whether a process lives, its command line, parent, memory and CPU time, its descendants; the
host's available memory, CPU identity and load.

Every reader answers "unknown" (None, an empty value, False) where the file is missing or unreadable: the
process has exited between two reads, or the host has no /proc (macOS), and callers decide what that means.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path


def has_procfs() -> bool:
    return os.path.isdir("/proc/self")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold spaces and parentheses): the
    state is [0], the parent's pid [1], user and system CPU ticks [11] and [12]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; a zombie (a killed child until its parent reaps it) does not."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            parent = parent_pid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def command_words(pid: int | None) -> list[str]:
    """The process's argv; empty once it has exited."""
    if not pid:
        return []
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [word.decode(errors="replace") for word in raw.split(b"\0") if word]


def command_line(pid: int | None) -> str:
    """The process's argv joined by spaces; "" once it has exited."""
    return " ".join(command_words(pid))


def rss_bytes(pid: int) -> int | None:
    """Resident memory (VmRSS); None once the process has exited (or is a zombie, which has none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None)


def anon_huge_pages_bytes(pid: int) -> int | None:
    """Anonymous memory the process holds on transparent huge pages (smaps_rollup's AnonHugePages)."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("AnonHugePages:")),
                None)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process has used so far."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available_bytes() -> int | None:
    """The host's MemAvailable."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_identity() -> str:
    """The CPU's model name and feature flags (what code built with -march=native depends on); the machine
    type where /proc/cpuinfo cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def cpu_flags() -> set[str]:
    return {flag for line in cpu_identity().splitlines() if line.startswith("flags")
            for flag in line.split(":", 1)[-1].split()}


def load_average() -> str:
    """The 1/5/15-minute load averages, or "unknown"."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def peer_pid_of_fd(fd: int) -> int | None:
    """The process at the other end of a connected unix socket (the kernel's SO_PEERCRED)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
    except (OSError, AttributeError):  # gone already, not a unix socket, or not Linux
        return None
    return pid or None
