"""The codebase rules of the style guide, checked: module size, class docstrings, repeated blocks, docs that name code.

A rule that is only written down drifts; these fail the build instead.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from collections.abc import Callable
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


# --- issue #27: the strategies stay simple, and no module reaches into a strategy's private state ---

STRATEGIES = sorted((PACKAGE / "strategies").rglob("*.py"))  # every folder of the strategies
LAYOUT = sorted((PACKAGE / "layout").rglob("*.py"))  # the plans the strategies run, held to the same rule
MAX_COMPLEXITY = 12
_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.IfExp, ast.comprehension, ast.match_case)


def _complexity(function: ast.AST) -> int:
    """McCabe's number: 1 + branches (if, loops, except, conditional expressions, comprehensions, match cases) + the
    extra operands of ``and``/``or``; a nested function counts in its parent, as one reading does."""
    count = 1
    for node in ast.walk(function):
        if isinstance(node, _BRANCHES):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
    return count


def test_no_function_is_more_complex_than_twelve():
    """Every function of the package (issue #27 set it for the strategies; plugins and meters now meet it too)."""
    complex_ = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _complexity(node) > MAX_COMPLEXITY:
                complex_.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_complexity(node)})")
    assert not complex_, f"functions above cyclomatic complexity {MAX_COMPLEXITY} (split them): {complex_}"


def _private_reads(path: Path, only: Callable[[ast.expr], bool] | None = None) -> list[str]:
    """``x._name`` reads of another object's private name: not ``self``/``cls``/``super()``, not defined here."""
    tree = ast.parse(path.read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value
        own = isinstance(base, ast.Name) and base.id in ("self", "cls")
        parent = isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
        if own or parent or node.attr in defined or (only is not None and not only(base)):
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def _is_strategy(expr: ast.expr) -> bool:
    text = ast.unparse(expr)
    return text.split(".")[-1] in ("strategy", "host") or text.endswith("strategy")


def test_no_module_reads_a_private_name_of_a_strategy_it_does_not_define():
    """Private Lightning/torch state only through utilities/_compat.py (and fixes in _workarounds.py)."""
    fenced = {"_compat.py", "_workarounds.py"}
    reads = [r for path in [*STRATEGIES, *LAYOUT] if path.name not in fenced for r in _private_reads(path)]
    reads += [r for path in MODULES if path.name not in fenced for r in _private_reads(path, _is_strategy)]
    assert not reads, f"private names read from other objects (go through a public name or _compat): {reads}"


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``; ``from a import _b`` names ``a._b`` too (a private submodule)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            found += [(node.lineno, module)]
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_nothing_outside_the_strategies_imports_their_modules():
    """The planner and the rest reach the strategies through ``lit_accel.strategies``; what both read is in layout/."""
    imports = [
        f"{path.relative_to(ROOT)}:{line} {name}"
        for path in MODULES
        if PACKAGE / "strategies" not in path.parents
        for line, name in _imported(path)
        if name.startswith("lit_accel.strategies.")
    ]
    assert not imports, f"imports of the strategies' modules (import from lit_accel.layout instead): {imports}"


def test_no_package_imports_another_packages_private_modules():
    """A package's ``_x`` modules are its own; the others import its public modules (``utilities`` is the package's
    own). The examples are what users copy: they import public modules only, ``utilities`` included."""
    imports = []
    for path in [*MODULES, *sorted((ROOT / "examples").rglob("*.py"))]:
        parts = path.relative_to(PACKAGE).parts if PACKAGE in path.parents else ()
        own = parts[0] if len(parts) > 1 else None  # (lit_accel/__init__.py, protocols.py and examples: none)
        shared = ("utilities",) if PACKAGE in path.parents else ()
        for line, name in _imported(path):
            package, *rest = name.split(".")[1:] if name.startswith("lit_accel.") else ("", "")
            if package not in (own, *shared) and any(part.startswith("_") for part in rest):
                imports.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not imports, f"imports of another package's private modules (give it a public module): {imports}"


_EXAMPLE_ONLY = ("timm", "torchmetrics")


def test_example_packages_are_extras_that_the_library_never_imports():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda requirements: {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0] for r in requirements}  # noqa: E731
    assert not names(project["dependencies"]) & set(_EXAMPLE_ONLY)
    for extra in ("examples", "test"):  # the examples and the tests that run them get them through these extras
        assert set(_EXAMPLE_ONLY) <= names(project["optional-dependencies"][extra]), extra
    imports = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imports += [f"{path.relative_to(ROOT)}:{node.lineno}" for m in modules if m.split(".")[0] in _EXAMPLE_ONLY]
    assert not imports, f"lit_accel/ imports an example-only package: {imports}"
