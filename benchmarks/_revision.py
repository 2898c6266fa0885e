"""Another git revision of llmbus, importable beside this checkout, for before/after benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from _smollm2 import dense_folder  # this folder: the scripts importing this module put it on the path

ROOT = Path(__file__).resolve().parent.parent


def add_comparison_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every this-checkout-against-a-revision benchmark takes: the revision, and the model as
    both sides serve it."""
    p.add_argument("--against", default="HEAD", help="the git revision to compare this checkout with")
    add_model_arguments(p)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model as both sides of a served comparison serve it."""
    p.add_argument("--model-id", default=None,
                   help="default: SmolLM2's bfloat16 folder (_smollm2.dense_folder), served in --dtype as "
                        "vs_llama_server.py serves it")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--quantize", default=None, choices=["int8", "int4"])


def comparison_model(model_id: str | None) -> Path:
    """The folder ``--model-id`` names, or its default."""
    return Path(model_id) if model_id else dense_folder("bfloat16")


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
