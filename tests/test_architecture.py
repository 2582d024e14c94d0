"""The package's shape holds: no import circles, `testing/` used only by tests, one precision policy, the plan made
in plan.py only, and a command line that only calls the API.

Imports are read from the source: every `import` and `from ... import`, at module level, inside a
function or under `if TYPE_CHECKING:`, so a lazy or type-only import that closes a circle is caught too.
Importing `a.b.c` runs the packages `a.b` first: an import counts as one of each enclosing package too
(a package's own `__init__` importing its submodules is how packages work, not a circle).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import clef_flash
from clef_flash.model.precision import ALIASES, PRECISION_CHOICES, PRECISIONS, parse_precision

PACKAGE_ROOT = Path(clef_flash.__file__).parent
PACKAGE = "clef_flash"


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(PACKAGE_ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports (a `from package import submodule` counts as both)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            enclosing = [".".join(target.split(".")[:end]) for end in range(2, target.count(".") + 1)]
            found.update(module for module in [target, *enclosing] if module in known and module != name)
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported_modules(name, path, known) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for neighbour in sorted(graph[node]):
            # A submodule importing its own package (whose __init__ imports it back) is how packages
            # work, not a circle; a package's __init__ importing its submodules counts, so a circle
            # that passes through a package's __init__ (a -> pkg -> pkg.b -> a) is found.
            if node.startswith(neighbour + "."):
                continue
            if state.get(neighbour) == 1:
                return path[path.index(neighbour) :] + [neighbour]
            if neighbour not in state and (cycle := visit(neighbour)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "clef_flash.checkpoint.loading" in graph["clef_flash.checkpoint.bundle"]  # relative imports resolved
    assert "clef_flash.request.records" in graph["clef_flash.engine.core"]
    assert "clef_flash.request" in graph["clef_flash.engine.core"]  # and the package it runs first
    assert "clef_flash.plan" in graph["clef_flash.engine.coreml_backend"]


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_nothing_outside_testing_imports_it():
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        if not name.startswith(f"{PACKAGE}.testing")
        for target in targets
        if target.startswith(f"{PACKAGE}.testing")
    )
    assert not offenders, offenders


# dtype and int8-mode decisions: only the precision policy names them (safetensors' dtype table and the
# random releases' generator draws aside, which describe files, not how the model computes).
DTYPE_PATTERN = re.compile(r"torch\.(bfloat16|float16|float32|float64|half|bfloat|int8)\b|\"weight-only\"|\"w8a8\"")
ALLOWED_DTYPE_FILES = {"model/precision.py", "checkpoint/safetensors_io.py"}


def test_dtype_decisions_live_in_the_precision_policy():
    offenders = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT).as_posix()
        if relative in ALLOWED_DTYPE_FILES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if DTYPE_PATTERN.search(line.split("#", 1)[0]):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_cli_precision_choices_are_what_the_policy_parses():
    from clef_flash.cli import build_parser

    parser = build_parser()
    answer = parser._subparsers._group_actions[0].choices["answer"]  # type: ignore[union-attr]
    (precision,) = [action for action in answer._actions if action.dest == "precision"]
    assert tuple(precision.choices) == PRECISION_CHOICES
    assert set(PRECISION_CHOICES) == {*PRECISIONS, *ALIASES}
    for name in precision.choices:
        assert parse_precision(name).name in PRECISIONS
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        parse_precision("fp16")


# -- the plan is the one currency; the shells only call the API (issue 41) ------------------------


def constructor_calls(path: Path, name: str) -> list[int]:
    """The lines of `path` that call `name(...)` or `something.name(...)`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if called == name:
                lines.append(node.lineno)
    return lines


def test_only_plan_py_constructs_a_plan():
    """Every place that needs a plan gets it from a named constructor of plan.py (resolve, coreml_plan, ...)."""
    offenders = [
        f"{path.relative_to(PACKAGE_ROOT).as_posix()}:{line}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if path.relative_to(PACKAGE_ROOT).as_posix() != "plan.py"
        for line in constructor_calls(path, "Plan")
    ]
    assert not offenders, offenders
    assert constructor_calls(PACKAGE_ROOT / "plan.py", "Plan")  # the check sees the constructors it allows


CLI_MODULES = ("cli", "cli_commands", "cli_options")  # the grammar's table, the commands, the options


def test_the_cli_imports_the_api_not_model_or_checkpoint_internals():
    """The command line parses, calls the public API and prints: nothing from model/, and of checkpoint/ only its
    front door (the package itself), never a module inside it."""
    graph = import_graph()
    imported = set().union(*(graph[f"{PACKAGE}.{module}"] for module in CLI_MODULES))
    offenders = sorted(
        name for name in imported if name.startswith(f"{PACKAGE}.model") or name.startswith(f"{PACKAGE}.checkpoint.")
    )
    assert not offenders, offenders
    assert f"{PACKAGE}.loader" in imported and f"{PACKAGE}.server.settings" in imported


CLI_LINE_BUDGETS = {"cli": 300, "cli_commands": 460, "cli_options": 200}  # logic belongs to the API, not here (+10: explain, fit-calibration)


def test_the_cli_stays_within_its_line_budget():
    for module, budget in CLI_LINE_BUDGETS.items():
        lines = len((PACKAGE_ROOT / f"{module}.py").read_text().splitlines())
        assert lines <= budget, f"{module}.py is {lines} lines (budget {budget}): move what computes into the API"


def test_the_front_ends_share_settings_not_each_other():
    """The MCP tools take the server's settings and checks from server/settings.py, never from the HTTP app; there
    is one uvicorn server function (server/transport.py)."""
    graph = import_graph()
    assert f"{PACKAGE}.server.app" not in graph[f"{PACKAGE}.server.mcp_tools"]
    assert f"{PACKAGE}.server.settings" in graph[f"{PACKAGE}.server.mcp_tools"]
    defining = [path.name for path in sorted((PACKAGE_ROOT / "server").glob("*.py")) if "def uvicorn_server(" in path.read_text()]
    assert defining == ["transport.py"]


def test_the_cli_parser_imports_no_web_framework():
    """`serve`'s and `mcp`'s flags come from ServerSettings without importing FastAPI (a `[serve]` extra)."""
    import subprocess
    import sys

    code = "import sys, clef_flash.cli as cli; cli.build_parser(); print('fastapi' in sys.modules, 'uvicorn' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False", "False"], result.stdout + result.stderr


def test_serve_and_mcp_flags_are_the_settings_fields_with_their_defaults():
    from clef_flash.cli import build_parser
    from clef_flash.server.settings import ServerSettings

    defaults = ServerSettings()
    for command in ("serve", "mcp"):
        args = build_parser().parse_args([command])
        for name in ServerSettings.flags(command):
            expected = os.environ.get("CLEF_FLASH_API_KEY") if name == "api_key" else getattr(defaults, name)
            assert getattr(args, name) == expected, (command, name)
