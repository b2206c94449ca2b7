"""The codebase rules of the style guide, checked: module size, class docstrings, repeated blocks, docs that name code.

A rule that is only written down drifts; these fail the build instead.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_accel"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_CLASS_DOCSTRING_LINES = 40
REPEAT_LINES = 6


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it by concept"


def test_class_docstrings_are_short():
    long = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            doc = ast.get_docstring(node, clean=False) if isinstance(node, ast.ClassDef) else None
            if doc and len(doc.splitlines()) > MAX_CLASS_DOCSTRING_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.name} ({len(doc.splitlines())} lines)")
    assert not long, f"class docstrings over {MAX_CLASS_DOCSTRING_LINES} lines (move the detail to docs/): {long}"


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines that carry code: no blank, comment, docstring, import or signature lines; whitespace folded.

    Signatures are declarations, not logic: two strategies that take the same arguments must declare them both.
    """
    source = path.read_text()
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            docstring_lines.update(range(node.lineno, node.body[0].lineno))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstring_lines.update(range(first.lineno, first.end_lineno + 1))
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        text = " ".join(line.split())
        if not text or text.startswith(("#", "import ", "from ")) or number in docstring_lines:
            continue
        if re.fullmatch(r"[\[\](){},:]*", text):
            continue
        out.append((number, text))
    return out


def test_no_block_of_six_code_lines_is_repeated():
    seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path in MODULES:
        lines = _code_lines(path)
        for i in range(len(lines) - REPEAT_LINES + 1):
            window = tuple(text for _, text in lines[i : i + REPEAT_LINES])
            seen[window].append(f"{path.relative_to(ROOT)}:{lines[i][0]}")
    repeated = {places[0]: places[1:] for places in seen.values() if len(places) > 1}
    assert not repeated, f"blocks of {REPEAT_LINES} identical code lines (fold them into one place): {repeated}"


def test_architecture_doc_names_only_code_that_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`(lit_accel/[\w/]+\.py)`", text))
    assert paths, "docs/architecture.md names no module"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    # `Name` or `Name.attr` / `module.Name` references that look like code (CamelCase classes, snake_case calls).
    names = set(re.findall(r"`((?:[A-Z][A-Za-z0-9]+)(?:\.[a-z_][a-z0-9_]*)?)(?:\(\))?`", text))
    defined = _defined_names()
    unknown = sorted(n for n in names if n.split(".")[0] not in defined and n.split(".")[0] not in _EXTERNAL)
    assert not unknown, f"docs/architecture.md names classes lit_accel does not define: {unknown}"
    for name in sorted(names):
        cls, _, attr = name.partition(".")
        if attr and cls in defined:
            assert any(hasattr(obj, attr) for obj in defined[cls]), f"{cls} has no attribute {attr!r}"


def test_architecture_doc_lists_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"`(lit_accel/[\w/]+\.py)`", text))
    modules = {str(p.relative_to(ROOT)) for p in MODULES if p.name != "__init__.py"}
    assert not modules - listed, f"add a row to docs/architecture.md for {sorted(modules - listed)}"


# Lightning/torch names the architecture page refers to.
_EXTERNAL = {
    "Linear",
    "DDPStrategy",
    "FlopCounterMode",
    "NamedTuple",
    "TypeError",
    "ValueError",
    "DistributedDataParallel",
    "FSDPModule",
    "GradScaler",
    "LayerSync",
    "LightningCLI",
    "MixedPrecision",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "Precision",
    "Trainer",
    "TorchSyncBatchNorm",
}


def _defined_names() -> dict[str, list[object]]:
    defined: dict[str, list[object]] = defaultdict(list)
    for path in MODULES:
        module = importlib.import_module(_module_name(path))
        for name, obj in vars(module).items():
            if isinstance(obj, type) and getattr(obj, "__module__", "").startswith("lit_accel"):
                defined[name].append(obj)
    return defined
