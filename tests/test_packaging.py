"""The wheel users install: built from this checkout, it carries the PEP 561 marker (``py.typed``) beside the code."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_typed_marker(tmp_path):
    # from a clean copy: a build/ folder left by an earlier build would hand its old files to the wheel
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs", "benchmarks", "tests", "docs")
    shutil.copytree(ROOT, source, ignore=skip)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("lit_accel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_accel/py.typed" in names and "lit_accel/__init__.py" in names, names[:20]
