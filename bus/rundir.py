"""The private run directory that holds one launch's ipc endpoints.

One directory per launch (mode 0700, so other users cannot connect to our sockets; the socket files
themselves are 0600), locked by the process that owns the launch with ``flock`` so a second launch on the
same directory fails with a clear message instead of silently stealing the endpoints (a second ``bind``
on an ipc path takes it over). A directory given by path that already exists must be ours: owned by this
user, a real directory (not a symlink) and closed to group and others; otherwise whoever created it could
swap the sockets or read prompts, and it is refused. The owner removes it on exit; a launch killed with
SIGKILL cannot, so each new launch removes this user's ``llmbus-*`` run dirs whose lock nobody holds.
Every endpoint may instead be a ``tcp://`` address (see ``Endpoints``) so services can live on different
hosts.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV_RUN_DIR = "LLMBUS_RUN_DIR"


class RunDirError(RuntimeError):
    """A run dir that cannot be used; the message says why and what to do."""


class RunDirInUse(RunDirError):
    pass


class RunDirNotPrivate(RunDirError):
    pass


# A unix socket's path holds at most this many bytes (sun_path's 108, its NUL included); the longest of a run
# dir's sockets is a frontend's events socket.
MAX_SOCKET_PATH = 107
_LONGEST_SOCKET = "events-f99.sock"


def _check_length(path: Path) -> None:
    longest = len(os.fsencode(path.absolute() / _LONGEST_SOCKET))
    if longest > MAX_SOCKET_PATH:
        raise RunDirError(f"run dir {path} is too long for its sockets ({longest} bytes with a socket's name; a "
                          f"unix socket's path holds {MAX_SOCKET_PATH}): pick a shorter --run-dir (or TMPDIR)")


def _claim(path: Path) -> None:
    """Create ``path`` private, or accept it if it already is: a directory of this user's, mode 0700 or
    stricter. Refuse anything else (and a path too long for the sockets in it)."""
    _check_length(path)
    try:
        path.mkdir(mode=0o700, parents=True)
        return
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RunDirNotPrivate(f"run dir {path} exists and is not a directory (a symlink or a file); "
                               f"remove it or pick another --run-dir")
    if info.st_uid != os.getuid():
        raise RunDirNotPrivate(f"run dir {path} belongs to uid {info.st_uid}, not to this user (uid "
                               f"{os.getuid()}): its owner could replace the sockets and read prompts; "
                               f"pick another --run-dir")
    if info.st_mode & 0o077:
        raise RunDirNotPrivate(f"run dir {path} has mode {stat.S_IMODE(info.st_mode):o}: group or others may "
                               f"reach its sockets; make it private (chmod 700) or pick another --run-dir")


def remove_stale_run_dirs(parent: str | os.PathLike) -> list[Path]:
    """This user's ``llmbus-*`` run dirs in ``parent`` whose launch is gone (its lock file is held by
    nobody), removed; the ones removed. Dirs without a lock file may be a launch starting: kept."""
    removed = []
    for candidate in Path(parent).glob("llmbus-*"):
        try:
            info = os.lstat(candidate)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(candidate / "lock", os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live launch holds it
        finally:
            os.close(fd)  # also releases our lock, if we took it
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


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
    """For services started on their own (Procfile): make the shared run dir, private, if none did yet;
    refuse one that is not ours (``RunDirNotPrivate``)."""
    d = Path(path)
    _claim(d)
    return d


def ensure_run_dir_or_exit(path: str | os.PathLike, prog: str) -> Path:
    """``ensure_run_dir`` for a service's entry point: a run dir that is not ours ends the process with
    ``prog: why`` on stderr and exit status 2."""
    try:
        return ensure_run_dir(path)
    except RunDirError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class RunDir:
    """Owns a run directory: creates it private, locks it, removes it on ``close``."""

    def __init__(self, path: str | os.PathLike | None = None):
        self._lock_fd = None
        if path is None:
            # /tmp keeps ipc paths short: a unix socket path must stay under ~107 bytes.
            parent = os.environ.get("TMPDIR", "/tmp")
            _check_length(Path(parent) / "llmbus-12345678")  # mkdtemp's name
            remove_stale_run_dirs(parent)
            self.path = Path(tempfile.mkdtemp(prefix="llmbus-", dir=parent))
            # The lock file appears already locked: created under another name, locked, then renamed. A
            # launch starting beside this one (remove_stale_run_dirs) would otherwise find "lock" unlocked
            # in the moment between its creation and its flock, and remove this dir before its sockets bind.
            self._lock_fd = os.open(self.path / "lock.new", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(self.path / "lock.new", self.path / "lock")
        else:
            self.path = Path(path)
            _claim(self.path)
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
