"""The import structure of the ``cpu_offload`` package, measured from its source.

Reads every module's ``import`` statements and ``importlib.import_module("...")`` calls
with ``ast`` (top level and inside functions, which a lazy import hides from a plain
import-time check), and reports:

- modules and import arrows between them (one arrow per importing/imported pair);
- import circles: strongly connected groups of more than one module;
- floors: a module's floor is one above the highest floor it imports (modules that import
  nothing of the package are on floor 0); a circle shares one floor;
- upward arrows: arrows from a module to one on its own floor or above (only possible
  inside a circle), listed with the file and line.

Usage: ``python tools/import_graph.py [PACKAGE_DIR] [--json]``; exits 1 when there is a
circle. Scope: imports of the package's own modules; not third-party imports.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


NATIVE_MODULES = ("_C",)  # extensions built from csrc/: leaves of the graph


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: Path, path: Path, known: set) -> list:
    """``[(imported module, line)]`` of one file, restricted to ``known`` modules."""
    name = module_name(root, path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def nearest(candidate: str):
        while candidate and candidate not in known:
            candidate = candidate.rpartition(".")[0]
        return candidate or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node)
            # ``from pkg import mod`` imports a module; ``from mod import name`` its module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]  # importlib.import_module("pkg.mod"): a lazy import by name
        else:
            continue
        for target in targets:
            hit = nearest(target)
            if hit is not None and hit != name:
                found.append((hit, node.lineno))
    return found


def strongly_connected(nodes: list, edges: dict) -> list:
    """Tarjan's algorithm: the strongly connected components, each a sorted list."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(max(1000, 10 * len(nodes)))
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def measure(package_dir: Path) -> dict:
    root = package_dir.resolve()
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    known = {module_name(root, p) for p in files}
    # NOTE: the native extension (built or not) is a module of its own, imported by name from
    # the package (``from cpu_offload import _C``): not an arrow to the package's __init__.
    known |= {f"{root.name}.{native}" for native in NATIVE_MODULES}
    edges: dict = {}
    where: dict = {}
    for path in files:
        src = module_name(root, path)
        for dst, line in imports_of(root, path, known):
            edges.setdefault(src, set()).add(dst)
            where.setdefault((src, dst), f"{path.relative_to(root.parent)}:{line}")
    nodes = sorted(known)
    comps = strongly_connected(nodes, edges)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    floor: dict = {}

    def floor_of(c: int) -> int:
        if c not in floor:
            floor[c] = 0
            below = {comp_of[d] for m in comps[c] for d in edges.get(m, ()) if comp_of[d] != c}
            floor[c] = 1 + max((floor_of(b) for b in below), default=-1)
        return floor[c]

    floors = {m: floor_of(comp_of[m]) for m in nodes}
    arrows = sorted((s, d) for s, ds in edges.items() for d in ds)
    upward = [(s, d, where[(s, d)]) for s, d in arrows if floors[d] >= floors[s]]
    return {
        "modules": len(nodes),
        "arrows": len(arrows),
        "floors": 1 + max(floors.values(), default=-1),
        "circles": [c for c in comps if len(c) > 1],
        "upward": upward,
        "floor_of": floors,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package_dir", nargs="?", default=str(Path(__file__).resolve().parents[1] / "cpu_offload"))
    parser.add_argument("--json", action="store_true", help="print the whole measurement as JSON")
    args = parser.parse_args(argv)
    result = measure(Path(args.package_dir))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['modules']} modules on {result['floors']} floors, {result['arrows']} import arrows, "
              f"{len(result['upward'])} upward, {len(result['circles'])} circles")
        for circle in result["circles"]:
            print("circle:", " -> ".join(circle))
        for src, dst, at in result["upward"]:
            print(f"upward: {src} -> {dst} ({at})")
    return 1 if result["circles"] else 0


if __name__ == "__main__":
    sys.exit(main())
