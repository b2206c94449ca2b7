"""The wheel users install: built from this checkout, it carries the PEP 561 marker (``py.typed``), so a user's type
checker (mypy here) reads lit_accel's annotations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a clean copy: a build/ folder left by an earlier build would hand it its old files."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs", "benchmarks", "tests", "docs")
    shutil.copytree(ROOT, source, ignore=skip)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (built,) = tmp.glob("lit_accel-*.whl")
    return built


def test_the_wheel_ships_the_typed_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_accel/py.typed" in names and "lit_accel/__init__.py" in names, names[:20]


# What a user's type checker sees: torch and Lightning are read as untyped (their own analysis takes minutes), so
# each type below comes from lit_accel's own annotations.
_MYPY_CONFIG = """[mypy]
follow_imports = silent
[mypy-torch.*,lightning.*,lightning_utilities.*,torchmetrics.*,numpy.*,typing_extensions]
follow_imports = skip
"""
_USER_SCRIPT = """from lit_accel import AccelDDP, AccelPrecision
precision = AccelPrecision("bf16-true")
strategy = AccelDDP(hang_timeout="60")
"""


def test_a_users_type_checker_sees_the_installed_packages_types(wheel, tmp_path):
    """mypy on a user's script, with the wheel installed apart from this checkout, reads lit_accel's annotations.

    Without the marker mypy skips the package (``import-untyped``) and every name is ``Any``: no error below.
    """
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (tmp_path / "mypy.ini").write_text(_MYPY_CONFIG)
    (tmp_path / "user.py").write_text(_USER_SCRIPT)
    # run from tmp_path (not this checkout), the wheel first on the path: mypy reads the interpreter's sys.path, where
    # an installed package counts only with the marker
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "user.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = done.stdout
    assert "import-untyped" not in out and "py.typed" not in out, out
    # (lit_accel's classes derive from Lightning's, read as Any here: their own signatures are what is checked)
    assert 'user.py:2: error: Argument 1 to "AccelPrecision" has incompatible type "Literal[\'bf16-true\']"' in out, out
    assert 'user.py:3: error: Argument "hang_timeout" to "AccelDDP" has incompatible type "str"' in out, out
    assert done.returncode == 1, out + done.stderr
