"""The import graph read from the source: imports point down the layer order, no module imports itself back.

The order is the one docs/architecture.md writes ("Layers"); `LAYERS` below is that table, bottom
first. Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:`, since
each is a dependency a reader has to hold. A function-level import (lazy) of any module, ours or
another package's, must say why on its line or the line above it (`# lazy: <reason>`), so that only
those that keep `dsctl --help` fast or keep CUDA / FlashInfer / Triton off a CPU path stay lazy.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "engine", "tuning", "dsctl")

# Bottom first. A module belongs to the longest prefix that names it; it may import its own layer's
# modules and any layer below, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels",),  # Triton kernels + torch references; tuned configs
    ("engine.errors",),  # user-facing errors
    ("engine.args", "engine.distributed.parallel_config"),  # flags and the parallel layout they describe
    ("engine.checkpoint",),  # model registry, config.json, resolution, tokenizer, cache dir, built-in models
    ("engine.sampling", "engine.forward_batch"),  # sampling parameters / sampling; one forward's batch
    ("engine.grammar",),  # grammar-constrained decoding: specs, compiled grammars, matchers, token masks
    # process groups, collectives, DP-attention gathers, a decode step's bytes floor; weight bytes by TP part
    ("engine.distributed", "engine.memory.weight_tally", "engine.memory.formats"),
    ("engine.memory",),  # KV pool, request table, radix cache, request memory
    ("engine.weights",),  # tensors from checkpoints (or dummy) into modules
    ("engine.model",),  # the DeepSeek modules, attention / MoE backends, the kernel registry
    ("engine.runner",),  # ModelRunner, CUDA graphs, Triton precompile
    ("engine.speculative",),  # NextN draft / verify
    ("engine.scheduler",),  # requests, continuous batching, outputs
    ("engine.engine",),  # one process's Engine
    ("engine.runtime",),  # rank processes, their loop and protocol, the clients
    ("engine.server",),  # HTTP
    ("tuning",),  # kernel config search
    ("dsctl",),  # the CLI
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module: of this project, or another package's dotted name
    line: int
    lazy: bool  # inside a function
    reason: bool  # a `# lazy:` comment on the line or the line above
    ours: bool = True  # the target is a module of this project


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    source = path.read_text()
    lines = source.splitlines()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def reason_at(lineno: int) -> bool:
        return any("# lazy:" in lines[i] for i in (lineno - 1, lineno - 2) if 0 <= i < len(lines))

    def add(name: str, node: ast.stmt, lazy: bool) -> None:
        target = _resolve(name, modules)
        if target is None:
            if name != "__future__.annotations":
                found.append(Import(module, name, node.lineno, lazy, reason_at(node.lineno), ours=False))
        elif target != module:
            found.append(Import(module, target, node.lineno, lazy, reason_at(node.lineno)))

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, lazy)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([child.module] if child.module else []))
                for alias in child.names:
                    add(f"{base}.{alias.name}", child, lazy)
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def all_imports(ours_only: bool = True) -> list[Import]:
    """Every import of a project module (`ours_only`), or every import of any module."""
    modules = project_modules()
    found = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return [imp for imp in found if imp.ours or not ours_only]


def layer_of(module: str) -> int:
    if module == "engine":
        return 0  # the package's face: a docstring, no imports
    best, depth = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    if best < 0:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py LAYERS")
    return best


def upward(imports: list[Import]) -> list[str]:
    return [f"{i.source}:{i.line} imports {i.target} ({LAYERS[layer_of(i.target)][0]} is above "
            f"{LAYERS[layer_of(i.source)][0]})" for i in imports if layer_of(i.target) > layer_of(i.source)]


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def unexplained_lazy(imports: list[Import]) -> list[str]:
    return [f"{i.source}:{i.line} imports {i.target} inside a function without a `# lazy: <reason>` comment"
            for i in imports if i.lazy and not i.reason]


def test_every_module_has_a_layer():
    for module in project_modules():
        layer_of(module)


def test_no_import_points_up_the_layers():
    assert upward(all_imports()) == []


def test_no_import_cycles():
    assert cycles(all_imports()) == []


def test_every_lazy_import_says_why():
    assert unexplained_lazy(all_imports(ours_only=False)) == []


def test_the_checks_catch_what_they_are_for():
    """The rules applied to a made-up graph: an upward import, a cycle, a lazy import without a reason."""
    made_up = [Import("engine.model.moe", "engine.runner.model_runner", 3, False, False),
               Import("engine.model.a", "engine.model.b", 1, False, False),
               Import("engine.model.b", "engine.model.a", 1, True, True),
               Import("engine.runner.x", "engine.model.a", 9, True, False)]
    assert len(upward(made_up)) == 1
    assert cycles(made_up) == [["engine.model.a", "engine.model.b"]]
    assert unexplained_lazy(made_up) == ["engine.runner.x:9 imports engine.model.a inside a function without a "
                                         "`# lazy: <reason>` comment"]


def test_the_layer_table_is_the_one_in_the_docs():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for prefixes in LAYERS:
        for prefix in prefixes:
            assert f"`{prefix}`" in doc, f"docs/architecture.md does not name layer {prefix}"
