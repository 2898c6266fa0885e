"""What a user's `pip install llmbus` (a wheel, not this checkout's editable install) would get: every
package folder of the source tree and the files read at run time. The editable install finds subpackages
through the folders themselves, so a package left out of pyproject.toml works here and fails for users
(workers/attention was)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("bus", "scheduler", "workers", "frontend", "supervisor", "bench", "testing")


def test_the_wheel_holds_every_package_and_its_data(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            str(source), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("llmbus-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    expected = set()
    for folder in PACKAGE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix in (".py", ".c", ".h") or (folder == "supervisor" and path.suffix == ".txt"):
                expected.add("llmbus/" + path.relative_to(ROOT).as_posix())
    missing = sorted(expected - names)
    assert not missing, f"left out of the wheel: {missing}"
