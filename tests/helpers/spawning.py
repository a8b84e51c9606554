"""Which tests start processes (a gloo world, the `meshkit` command, a launcher) — marked `world` at collection.

A function spawns when its body starts a process (`subprocess`, `multiprocessing`, `run_world`) or calls a
function that does, found over every module of the suite to a fixed point. A test spawns when its own body or a
fixture it uses does. The conftest also fails an unmarked test that starts a process anyway, so the split between
fast single-process tests and worlds cannot drift.
"""

from __future__ import annotations

import ast
from pathlib import Path

STARTS_A_PROCESS = {"run_world", "Popen", "check_output", "check_call", "Process", "Pool"}
PROCESS_MODULES = {"subprocess", "mp", "multiprocessing"}


def _called_names(function: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif isinstance(target, ast.Attribute):
                names.add(target.attr)
                if isinstance(target.value, ast.Name) and target.value.id in PROCESS_MODULES:
                    names.add("Popen")  # subprocess.run, mp.get_context(...): a process is started
    return names


def spawning_functions(root: Path) -> set[str]:
    """Names of the suite's functions that start a process, directly or through another such function."""
    calls: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls.setdefault(node.name, set()).update(_called_names(node))
    spawning = set(STARTS_A_PROCESS)
    while True:
        more = {name for name, called in calls.items() if name not in spawning and called & spawning}
        if not more:
            return spawning
        spawning |= more


def spawns(function_source: str, fixture_names: list[str], spawning: set[str]) -> bool:
    """Whether a test (its source and its fixtures' names) starts a process."""
    tree = ast.parse(function_source)
    return bool(_called_names(tree) & spawning) or any(name in spawning for name in fixture_names)
