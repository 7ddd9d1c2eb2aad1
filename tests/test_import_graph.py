"""The package's imports run one way: no cycle among fp8_align modules, no import from a lower
layer into a higher one.

Read from the source with `ast` (nothing is imported): every `import` / `from ... import`
statement counts, at module level or inside a function, so an import moved into a function
cannot hide a cycle. Importing `a.b.c` also runs the `__init__` of `a.b` (unless the importer
lives inside it), so those edges count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "src" / "fp8_align"

#: Layers of the package, lowest first: a module imports only from its own layer or lower ones.
#: Keys are modules or packages (a package covers its modules; the longest key decides); the
#: root `fp8_align` covers only its `__init__`, so a new top-level module needs its own entry.
LAYERS: dict[str, int] = {
    "fp8_align": 0,  # re-exports the config
    "fp8_align.config": 0,
    "fp8_align.errors": 0,
    "fp8_align.nemo_rl_config": 0,
    "fp8_align.versions": 0,
    "fp8_align.metrics": 0,
    "fp8_align.quant": 0,
    "fp8_align.rounding": 0,
    "fp8_align.checks": 0,
    "fp8_align.layer_selection": 0,
    "fp8_align.bitwise": 0,
    "fp8_align.is_correction": 1,
    "fp8_align.hf_emulation": 1,
    "fp8_align.megatron_ext": 1,
    "fp8_align.megatron_ext.bitwise": 2,  # the bitwise spec runs hf_training's engine ops
    "fp8_align.vllm_plugin": 1,
    "fp8_align.hf_training": 2,
    "fp8_align.adapters": 2,
    "fp8_align.trl_engine": 2,  # TRL's engine made an fp8_align one; K/V scales by the trainer-side calibrator
    "fp8_align.doctor": 3,
    "fp8_align.error_bench": 3,
    "fp8_align.cli": 4,
}


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every module and package of fp8_align."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the fp8_align modules importing it runs (see the module docstring)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        edges = set()
        for target in targets:
            parts = target.split(".")
            for depth in range(1, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                implicit = depth < len(parts)
                if prefix in modules and prefix != name and not (implicit and (name + ".").startswith(prefix + ".")):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def layer_of(module: str) -> int:
    """The layer of `module`: that of the longest `LAYERS` key naming it or a package above it."""
    matches = [key for key in LAYERS if module == key or (key != "fp8_align" and module.startswith(key + "."))]
    assert matches, f"{module} has no layer in LAYERS"
    return LAYERS[max(matches, key=len)]


def test_find_cycle_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "fp8_align"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from fp8_align.sub.b import f\n")
    (package / "sub" / "__init__.py").write_text("from fp8_align.sub.c import g\n")
    (package / "sub" / "b.py").write_text("def f():\n    return 1\n")
    (package / "sub" / "c.py").write_text("def g():\n    from fp8_align.a import f\n")
    graph = import_graph(module_files(package))
    assert graph["fp8_align.a"] == {"fp8_align.sub", "fp8_align.sub.b"}  # the package __init__ runs first
    assert find_cycle(graph) == ["fp8_align.a", "fp8_align.sub", "fp8_align.sub.c", "fp8_align.a"]


def test_no_import_cycle_among_fp8_align_modules() -> None:
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_imports_a_higher_layer() -> None:
    graph = import_graph(module_files())
    upward = sorted(
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )
    assert not upward, "\n".join(upward)
