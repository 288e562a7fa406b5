"""The benchmarks' import graph, read from the source: no import cycle among
its modules, harness <- workloads <- reporting <- experiments (each part
imports only the parts before it), and only harness/product.py imports
ddp_ext's private modules."""

import ast
import os

import benchmarks

PACKAGE_DIR = os.path.dirname(os.path.abspath(benchmarks.__file__))
LAYERS = ("harness", "workloads", "reporting", "experiments")
SEAM = "benchmarks.harness.product"


def _modules() -> dict:
    found = {}
    for directory, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = ["benchmarks", *os.path.relpath(path, PACKAGE_DIR)[:-3].split(os.sep)]
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: str) -> set:
    """Every module name an import statement of the file names (from x import y: x and x.y)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _graph():
    modules = _modules()
    return modules, {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}


def _layer(module: str):
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_parts_exist():
    modules, _ = _graph()
    for layer in LAYERS:
        assert f"benchmarks.{layer}" in modules


def test_no_import_cycle():
    _, edges = _graph()
    done, on_path = set(), []

    def visit(module):
        on_path.append(module)
        for target in sorted(edges[module]):
            assert target not in on_path, "import cycle: " + " -> ".join(on_path[on_path.index(target):] + [target])
            if target not in done:
                visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            visit(module)


def test_each_part_imports_only_the_parts_before_it():
    _, edges = _graph()
    upward = [(a, b) for a, targets in edges.items() for b in targets
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert upward == []


def test_only_the_seam_imports_private_product_modules():
    modules, _ = _graph()
    reaching = {}
    for module, path in modules.items():
        private = sorted(n for n in _imports(path) if n.startswith("ddp_ext.")
                         and any(part.startswith("_") for part in n.split(".")[1:]))
        if private:
            reaching[module] = private
    assert set(reaching) == {SEAM}, reaching
