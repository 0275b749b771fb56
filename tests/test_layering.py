"""The package's layering: dependencies flow one way (checked on the source with ``ast``).

- no import cycle between the package's modules, lazy imports inside functions included;
- ``api.py`` imports the implementations and only the front ends import it back (the package
  ``__init__``, ``modules.py``, ``models/``, ``integrations/``, ``cli.py``, ``train.py``);
- the leaf modules (input checks, block geometry, plan cache, branch bookkeeping, LSE merge,
  the process switch, the argparse value types)
  import nothing from the package beyond each other.
"""

from __future__ import annotations

import ast
import pathlib

import dilated_attention

PKG = "dilated_attention"
ROOT = pathlib.Path(dilated_attention.__file__).parent
API_IMPORTERS = {"", "modules", "cli", "train"}  # "" is the package __init__
API_IMPORTER_PACKAGES = ("models", "integrations")
LEAVES = {"checks", "geometry", "plan_cache", "branches", "merge", "flags", "argtypes"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join((PKG, *parts))] = f
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """Package modules that ``name`` imports anywhere in its source (top level or lazily)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            cands = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            continue
        # a submodule's import of an enclosing package is how Python loads packages, not a
        # dependency on that package's __init__
        out |= {c for c in cands if c in mods and c != name and not name.startswith(c + ".")}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def _short(m: str) -> str:
    return m[len(PKG) + 1 :] if m != PKG else ""


def test_graph_sees_imports():
    """The parser finds relative, absolute and lazy imports (else the checks below prove nothing)."""
    g = _graph()
    assert f"{PKG}.api" in g[PKG]
    assert f"{PKG}.checks" in g[f"{PKG}.api"]
    assert f"{PKG}.kernels.block_attention" in g[f"{PKG}.distributed.ring"]
    assert f"{PKG}.distributed.sequence_parallel" in g[f"{PKG}.api"]  # lazy, inside a function


def test_no_import_cycle():
    g = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(map(_short, c)) for c in cycles)


def test_only_front_ends_import_api():
    g = _graph()
    bad = sorted(
        _short(m) for m, deps in g.items()
        if f"{PKG}.api" in deps
        and _short(m) not in API_IMPORTERS
        and not _short(m).startswith(API_IMPORTER_PACKAGES)
    )
    assert not bad, f"modules that import api.py (import checks / kernels.select instead): {bad}"


def test_leaf_modules():
    g = _graph()
    for leaf in LEAVES:
        deps = {_short(d) for d in g[f"{PKG}.{leaf}"]}
        assert deps <= LEAVES, f"{leaf}.py must import only other leaf modules, imports {deps - LEAVES}"
