"""The package layout is what the README's Layout section says it is.

The arrows between packages are read from the code (every ``import`` and ``from ... import`` in
``src/swiftune``, function-local ones included) and compared with the block at the top of the
README's Layout section, so the documentation and the code cannot drift apart. The same walk
checks the rules of the architecture: layers import only from layers below them, the trainers
are siblings, ``memory`` is a leaf without torch, Triton lives in ``kernels``, there are no
import cycles between modules, and no module reaches into another module's private names.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "swiftune"

# Modules that only re-export names from their new home for one release. They are skipped by
# the arrow checks (they point upwards on purpose) but must stay pure re-exports.
DEPRECATED_MARK = "Deprecated alias of"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Module:
    def __init__(self, path: Path):
        self.path = path
        self.name = _module_name(path)
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text(), filename=str(path))
        doc = ast.get_docstring(self.tree) or ""
        self.deprecated = doc.startswith(DEPRECATED_MARK)
        self.imports: list[tuple[str, list[str]]] = []  # (module imported, names taken from it)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                self.imports += [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(self.name, self.is_package, node)
                self.imports.append((target, [a.name for a in node.names]))

    @property
    def package(self) -> str:
        """The top-level subpackage (``kernels``, ``rl``, ...); a module directly under
        ``swiftune`` (``errors``, ``local_paths``) is its own package."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else "<root>"

    def swiftune_imports(self) -> list[tuple[str, list[str]]]:
        return [(m, n) for m, n in self.imports if m == "swiftune" or m.startswith("swiftune.")]


MODULES = [Module(p) for p in sorted(SRC.rglob("*.py"))]
NAMES = {m.name for m in MODULES}
# The facade (swiftune/__init__.py, swiftune/__main__.py) may import every layer.
FACADE = {"swiftune", "swiftune.__main__"}


def _package_of(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _layout_block() -> dict[str, set[str]]:
    """``package -> its imports`` from the first ```text block of the README's Layout section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "README's Layout section starts with a ```text block of the package arrows"
    arrows: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        m = re.match(r"\s*(\w+)(?:/|\.py)?\s.*?(?:->\s*(.*))?$", line)
        if not m or line.strip().startswith("#"):
            continue
        deps = m.group(2) or ""
        arrows[m.group(1)] = {d.strip() for d in re.split(r"[,\s]+", deps) if d.strip() and d.strip() != "-"}
    return arrows


def _actual_arrows() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = defaultdict(set)
    for mod in MODULES:
        if mod.name in FACADE or mod.deprecated:
            continue
        arrows[mod.package]  # every package appears, with no arrows if it imports nothing
        for target, _ in mod.swiftune_imports():
            pkg = _package_of(target)
            if pkg not in (mod.package, "<root>"):
                arrows[mod.package].add(pkg)
            elif pkg == "<root>" and target != "swiftune":
                arrows[mod.package].add(target.split(".")[1])
    # top-level modules (swiftune/errors.py, ...) count as packages of their own
    return {k.removesuffix(".py"): v for k, v in arrows.items() if k != "<root>"}


# The layers, lowest first; a package may import only packages before it in this order.
# `memory` comes first: a leaf anyone may import. The trainers `sft` and `rl` share a layer.
ORDER = ["memory", "errors", "local_paths", "kernels", "losses", "attention", "models", "data",
         "training", ("sft", "rl"), "cli"]


def _rank(pkg: str) -> int:
    for i, layer in enumerate(ORDER):
        if pkg == layer or (isinstance(layer, tuple) and pkg in layer):
            return i
    raise AssertionError(f"package {pkg!r} has no place in the layer order of tests/test_layout.py")


def test_readme_layout_arrows_match_the_code():
    documented, actual = _layout_block(), _actual_arrows()
    assert set(documented) == set(actual), (
        f"packages in README but not in the code: {sorted(set(documented) - set(actual))}; "
        f"in the code but not in README: {sorted(set(actual) - set(documented))}")
    wrong = {p: (sorted(documented[p]), sorted(actual[p])) for p in actual if documented[p] != actual[p]}
    assert not wrong, f"README arrows (documented, actual) differ: {wrong}"


def test_layers_import_only_from_below():
    upward = []
    for mod in MODULES:
        if mod.name in FACADE or mod.deprecated:
            continue
        for target, _ in mod.swiftune_imports():
            pkg = _package_of(target)
            if pkg == "<root>" or pkg == mod.package:
                continue
            if _rank(pkg) >= _rank(mod.package):
                upward.append(f"{mod.name} imports {target}")
    assert not upward, "imports from the same layer or above:\n" + "\n".join(upward)


def test_trainers_are_siblings():
    crossing = [f"{m.name} imports {t}" for m in MODULES if m.package in ("sft", "rl") and not m.deprecated
                for t, _ in m.swiftune_imports()
                if _package_of(t) in ({"sft", "rl"} - {m.package}) | {"cli"}]
    assert not crossing, "\n".join(crossing)


def test_memory_is_a_torch_free_leaf():
    bad = [f"{m.name} imports {t}" for m in MODULES if m.package == "memory"
           for t, _ in m.imports if t.split(".")[0] in ("torch", "triton", "transformers", "swiftune")
           and not t.startswith("swiftune.memory")]
    assert not bad, "\n".join(bad)


def _triton_kernels(mod: Module) -> list[str]:
    """Functions decorated ``@triton.jit`` / ``@triton.autotune(...)`` (however triton was imported)."""
    found = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                dec = dec.func if isinstance(dec, ast.Call) else dec
                name = dec.attr if isinstance(dec, ast.Attribute) else getattr(dec, "id", "")
                if name in ("jit", "autotune", "heuristics"):
                    found.append(f"{mod.name}.{node.name}")
    return found


def test_triton_only_in_kernels():
    importing = [m.name for m in MODULES if m.package != "kernels"
                 and any(t == "triton" or t.startswith("triton.") for t, _ in m.imports)]
    assert not importing, f"modules outside swiftune.kernels import triton: {importing}"
    kernels = [k for m in MODULES if m.package != "kernels" for k in _triton_kernels(m)]
    assert not kernels, f"Triton kernels outside swiftune.kernels: {kernels}"


def test_no_import_cycles():
    graph: dict[str, set[str]] = defaultdict(set)
    for mod in MODULES:
        if mod.deprecated:
            continue
        for target, names in mod.swiftune_imports():
            # `from pkg import submodule` depends on the submodule, not on the package's __init__
            deps = {f"{target}.{n}" for n in names if f"{target}.{n}" in NAMES} or {target}
            for dep in deps:
                while dep not in NAMES and "." in dep:
                    dep = dep.rsplit(".", 1)[0]
                if dep != mod.name and not mod.name.startswith(dep + ".") and dep != "swiftune":
                    graph[mod.name].add(dep)
    # a package __init__ importing its own submodules is how packages work, not a cycle
    for name in list(graph):
        graph[name] = {d for d in graph[name] if not (d in NAMES and name.startswith(d + "."))}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # package __init__ files re-export from their submodules: an edge back into an __init__ of
    # the same package is the package importing itself, not a design cycle
    cycles = [c for c in cycles if not any(
        b in NAMES and any(m.is_package and m.name == b for m in MODULES) and a.startswith(b + ".")
        for a, b in zip(c, c[1:]))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    """``from swiftune.x import _name`` or importing a ``_module`` of another package reaches into
    code its owner may change freely."""
    bad = []
    for mod in MODULES:
        if mod.deprecated:
            continue
        for target, names in mod.swiftune_imports():
            if target == mod.name:
                continue
            tail = target.split(".")
            if any(p.startswith("_") and not p.startswith("__") for p in tail) and _package_of(target) != mod.package:
                bad.append(f"{mod.name} imports private module {target}")
            bad += [f"{mod.name} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_library_code_never_exits():
    """Only the command line turns errors into exit codes; library code raises errors that say
    what to change."""
    bad = []
    for mod in MODULES:
        if mod.package == "cli" or mod.name in FACADE:
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "SystemExit":
                    bad.append(f"{mod.name}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "exit" and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "sys":
                bad.append(f"{mod.name}:{node.lineno} (sys.exit)")
    assert not bad, "SystemExit outside swiftune.cli: " + ", ".join(bad)


@pytest.mark.parametrize("mod", [m for m in MODULES if m.deprecated], ids=lambda m: m.name)
def test_deprecated_aliases_only_re_export(mod):
    body = [n for n in mod.tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    allowed = (ast.Import, ast.ImportFrom, ast.Assign)
    assert all(isinstance(n, allowed) for n in body), f"{mod.name} is marked deprecated but holds code"
