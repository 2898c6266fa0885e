"""The private run directory that holds one launch's ipc endpoints.

One directory per launch (mode 0700, so other users cannot connect to our sockets), locked by the
process that owns the launch with ``flock`` so a second launch on the same directory fails with a clear
message instead of silently stealing the endpoints (a second ``bind`` on an ipc path takes it over).
The owner removes it on exit; nothing is left behind. Every endpoint may instead be a ``tcp://`` address
(see ``Endpoints``) so services can live on different hosts.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV_RUN_DIR = "LLMBUS_RUN_DIR"


class RunDirInUse(RuntimeError):
    pass


@dataclass(frozen=True)
class Endpoints:
    """Where each socket of a launch lives; every service derives them from the same run dir."""

    requests: str  # scheduler PULL <- frontends' AddRequest / AbortRequest / FrontendHello
    steps: str  # scheduler XPUB -> every rank's SUB: StepCommand / Shutdown
    results: str  # scheduler PULL <- rank 0: StepResult
    control: str  # scheduler PULL <- every rank: WorkerHello / WorkerReady / WorkerFatal
    supervisor: str  # supervisor PULL <- every service: ServiceReady / ServiceFatal

    @classmethod
    def in_dir(cls, run_dir: str | os.PathLike) -> "Endpoints":
        d = Path(run_dir)
        return cls(**{name: f"ipc://{d / name}.sock" for name in cls.__dataclass_fields__})

    def frontend_events(self, run_dir: str | os.PathLike, frontend_id: str) -> str:
        return f"ipc://{Path(run_dir) / f'events-{frontend_id}'}.sock"


def ensure_run_dir(path: str | os.PathLike) -> Path:
    """For services started on their own (Procfile): make the shared run dir, private, if none did yet."""
    d = Path(path)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


class RunDir:
    """Owns a run directory: creates it private, locks it, removes it on ``close``."""

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            # /tmp keeps ipc paths short: a unix socket path must stay under ~107 bytes.
            self.path = Path(tempfile.mkdtemp(prefix="llmbus-", dir=os.environ.get("TMPDIR", "/tmp")))
        else:
            self.path = Path(path)
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(self._lock_fd, 32).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            raise RunDirInUse(f"run dir {self.path} is in use by another llmbus launch (pid {owner}); "
                              f"stop it or pick another --run-dir") from None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, str(os.getpid()).encode())
        self.endpoints = Endpoints.in_dir(self.path)

    def close(self) -> None:
        if self._lock_fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
