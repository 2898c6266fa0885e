"""The run dir is ours (issue #18): one given by path must be a directory of this user's that group and
others cannot enter, or the launch and every service refuse it with a clear message; socket files are
0600; a launch killed with SIGKILL leaves a run dir that the next launch removes, while live launches'
dirs are kept."""

import fcntl
import os
import subprocess
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner

from llmbus.bus.rundir import RunDir, RunDirNotPrivate, ensure_run_dir, remove_stale_run_dirs
from llmbus.bus.sockets import open_socket
from llmbus.supervisor.cli import main


def _foreign(tmp_path: Path) -> Path:
    if os.getuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    d = tmp_path / "foreign"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    return d


def _loose(tmp_path: Path) -> Path:
    d = tmp_path / "loose"
    d.mkdir()
    os.chmod(d, 0o755)
    return d


def _symlink(tmp_path: Path) -> Path:
    (tmp_path / "target").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    return tmp_path / "link"


@pytest.mark.parametrize("make,reason", [(_foreign, "belongs to uid 12345"), (_loose, "has mode 755"),
                                         (_symlink, "is not a directory")])
def test_run_dirs_not_ours_are_refused(tmp_path, tiny_model_dir, make, reason):
    d = make(tmp_path)
    with pytest.raises(RunDirNotPrivate, match=reason):
        RunDir(d)
    with pytest.raises(RunDirNotPrivate, match=reason):
        ensure_run_dir(d)
    for service, extra in (("scheduler", []), ("workers", ["--model-dir", str(tiny_model_dir)]),
                           ("frontend", ["--model-dir", str(tiny_model_dir)])):
        done = subprocess.run([sys.executable, "-m", "llmbus.supervisor", service, "--run-dir", str(d), *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and reason in done.stderr, (service, done.stderr[-2000:])
    result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), "--run-dir", str(d)])
    assert result.exit_code != 0 and reason in result.output, result.output


def test_own_private_dirs_are_accepted_and_sockets_are_0600(tmp_path):
    existing = tmp_path / "mine"
    existing.mkdir(mode=0o700)
    with RunDir(existing) as run_dir:
        ctx = zmq.Context()
        sock = open_socket(ctx, zmq.PULL, run_dir.endpoints.requests)
        try:
            mode = os.stat(run_dir.endpoints.requests.removeprefix("ipc://")).st_mode & 0o777
            assert mode == 0o600
        finally:
            sock.close(0)
            ctx.term()
    assert ensure_run_dir(tmp_path / "new" / "dir").stat().st_mode & 0o777 == 0o700


@pytest.fixture
def short_parent():
    """A TMPDIR short enough for a run dir's sockets (pytest's tmp_path is not)."""
    parent = Path(tempfile.mkdtemp(dir="/tmp"))
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def test_a_killed_launch_leaves_nothing_the_next_launch_keeps(short_parent, monkeypatch):
    parent = short_parent
    stale = Path(tempfile.mkdtemp(prefix="llmbus-", dir=parent))
    (stale / "lock").write_text("999999")  # its launch was SIGKILLed: nobody holds the lock
    (stale / "requests.sock").touch()
    live = Path(tempfile.mkdtemp(prefix="llmbus-", dir=parent))
    holder = os.open(live / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    starting = Path(tempfile.mkdtemp(prefix="llmbus-", dir=parent))  # no lock file yet: a launch starting
    try:
        monkeypatch.setenv("TMPDIR", str(parent))
        with RunDir() as run_dir:
            assert not stale.exists() and live.is_dir() and starting.is_dir()
            assert run_dir.path.parent == parent
        assert remove_stale_run_dirs(parent) == []
    finally:
        os.close(holder)


def test_a_launch_starting_beside_another_never_removes_its_dir(short_parent, monkeypatch):
    """Another launch's sweep (remove_stale_run_dirs) run in the moment before this launch locks its dir
    leaves the dir alone: a "lock" file that exists is always held. Two launches side by side lost a run
    dir this way ("No such file or directory for ipc path ... supervisor.sock")."""
    from llmbus.bus import rundir

    parent = short_parent
    monkeypatch.setenv("TMPDIR", str(parent))
    real_flock, swept = fcntl.flock, []

    def flock_after_a_sweep(fd, operation):
        monkeypatch.setattr(rundir.fcntl, "flock", real_flock)  # the sweep's own locks are real ones
        swept.extend(remove_stale_run_dirs(parent))  # the other launch, just before this one locks
        return real_flock(fd, operation)

    monkeypatch.setattr(rundir.fcntl, "flock", flock_after_a_sweep)
    with RunDir() as run_dir:
        assert run_dir.path.is_dir() and swept == []
