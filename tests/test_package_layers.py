"""The package graph: imports point down the layers of docs/architecture.md, no module imports itself back, a small
root.

Read from the source (every `import`, also those inside functions and under TYPE_CHECKING), so an import that
only runs later still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import meshkit

PACKAGE = Path(meshkit.__file__).parent
# Lowest first; a module may import its own layer and those below it. The root package (`meshkit`: the public
# names, imported lazily) sits above everything.
LAYERS = [
    ("core",),
    ("config",),
    ("runtime",),
    ("models",),
    ("training",),
    ("data",),
    ("parallel",),
    ("checkpoint",),
    ("paramserver", "launching"),
    ("planning",),
    ("engine",),
    ("tuning",),  # (what a fine-tune applies to a model: LoRA, ReLoRA, LISA, QAT, Liger; over the Engine)
    ("compat",),  # (other tools' surfaces over the Engine: `meshkit.Accelerator`)
    ("logging",),  # (Accelerate's logger, as `meshkit.logging` for scripts that import everything from meshkit)
    ("recipes",),
    ("cli",),
]
LAYER_OF = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}
# Inside `parallel/`: one package or module per strategy, none importing another (the composition layer orders
# them), then what reads several strategies' facts, then the composition itself.
PARALLEL_LAYERS = [
    ("activation", "compile", "context", "dataparallel", "ddp", "expert", "fsdp", "pipeline", "replicate")
    + ("routed", "tensor", "tiled_mlp", "zero"),
    ("applied", "layout_fit", "materialize", "sequence_seen"),
    ("compose",),
]
PARALLEL_LAYER_OF = {entry: rank for rank, entries in enumerate(PARALLEL_LAYERS) for entry in entries}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(name: str, path: Path) -> set[str]:
    """meshkit modules `name` imports (`from meshkit.x import y` counts as meshkit.x.y when y is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{name}: relative import; meshkit imports by absolute path"
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the root package
    return LAYER_OF[parts[1]]


def entry(name: str) -> str | None:
    """The package (or module) directly under the layers' package: `meshkit.parallel.tensor.auto` -> tensor."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 else None


def crossings(layers: list[tuple[str, ...]], package: str) -> list[str]:
    """Imports inside `meshkit.<package>` that go up its layers or sideways between two entries of one layer."""
    rank_of = {item: rank for rank, items in enumerate(layers) for item in items}
    prefix = f"meshkit.{package}."
    wrong = []
    for name, targets in GRAPH.items():
        if not name.startswith(prefix):
            continue
        for target in targets:
            source_entry, target_entry = entry(name), entry(target)
            if not target.startswith(prefix) or source_entry == target_entry:
                continue
            if rank_of[target_entry] >= rank_of[source_entry]:
                wrong.append(f"{name} -> {target}")
    return sorted(wrong)


def test_every_package_has_a_layer_and_the_root_stays_small() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 18, entries  # 17 packages and __init__.py
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == set(LAYER_OF), (
        "a package with no layer: add it to LAYERS (and to docs/architecture.md's layer list)"
    )
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules at the root belong in a package: {loose}"


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if len(target.split(".")) > 1 and layer(target) > layer(name)
    ]
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(sorted(upward))


def test_no_module_imports_the_root_package() -> None:
    # The root holds the public names and imports them lazily; a module that imports it reaches every layer.
    importers = sorted(name for name, targets in GRAPH.items() if "meshkit" in targets and name != "meshkit")
    assert not importers, (
        f"modules importing the root package `meshkit` (import the module that defines it): {importers}"
    )


def test_the_top_layers_do_not_import_each_other() -> None:
    sideways = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if len(name.split(".")) > 1
        and len(target.split(".")) > 1
        and layer(name) == layer(target)
        and name.split(".")[1] != target.split(".")[1]
    ]
    assert not sideways, f"packages of one layer importing each other: {sorted(sideways)}"


def test_parallel_strategies_stand_alone_and_compose_sits_on_top() -> None:
    entries = {p.stem for p in (PACKAGE / "parallel").iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert entries == set(PARALLEL_LAYER_OF), "a module of parallel/ with no layer: add it to PARALLEL_LAYERS"
    wrong = crossings(PARALLEL_LAYERS, "parallel")
    assert not wrong, "parallel/ imports going up or between two strategies:\n" + "\n".join(wrong)


def test_the_crossing_finder_finds_a_sideways_and_an_upward_import() -> None:
    GRAPH["meshkit.parallel.ddp._probe"] = {"meshkit.parallel.fsdp", "meshkit.parallel.compose"}
    try:
        assert crossings(PARALLEL_LAYERS, "parallel") == [
            "meshkit.parallel.ddp._probe -> meshkit.parallel.compose",
            "meshkit.parallel.ddp._probe -> meshkit.parallel.fsdp",
        ]
    finally:
        del GRAPH["meshkit.parallel.ddp._probe"]


def test_the_architecture_note_lives_in_the_project() -> None:
    note = PACKAGE.parent / "docs" / "architecture.md"
    text = note.read_text()
    for package in LAYER_OF:
        assert f"{package}/" in text, f"docs/architecture.md does not place {package}/"


def test_there_are_no_import_cycles() -> None:
    cycles = strongly_connected(GRAPH)
    assert not cycles, f"modules that import each other: {cycles}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
