"""Another git revision of llmbus, importable beside this checkout, for before/after benchmarks."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def revision_package(revision: str, tool: str) -> Iterator[Path]:
    """A folder to put first on ``PYTHONPATH`` so that ``import llmbus`` takes ``revision``.

    The revision is checked out into a temporary git worktree (removed on exit); the folder holds an
    ``llmbus`` link to it, since the repository root is the package. ``tool`` names the caller in the
    message printed when git cannot check the revision out."""
    with tempfile.TemporaryDirectory(prefix="llmbus-ab-") as tmp:
        tree, package = Path(tmp) / "tree", Path(tmp) / "package"
        checkout = ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), revision]
        if subprocess.run(checkout).returncode:
            sys.exit(f"{tool}: cannot check out {revision!r} (see git's message above)")
        try:
            package.mkdir()
            (package / "llmbus").symlink_to(tree)
            yield package
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
