"""No hidden process state in distributed/: no module-level dict, list or set that the code
changes (statistics are returned to the caller, options travel as arguments or in the object of
a ``with`` block), and the library sets no environment variable (checked on the source, ``ast``)."""

from __future__ import annotations

import ast
import pathlib

import dilated_attention

ROOT = pathlib.Path(dilated_attention.__file__).parent
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "remove", "__setitem__"}


def _mutable_globals(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("dict", "list", "set")
        )
        if mutable:
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _mutations(tree: ast.Module, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names:
                    found.append(f"line {node.lineno}: {t.value.id}[...] changed")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in names
                and node.func.attr in MUTATORS):
            found.append(f"line {node.lineno}: {node.func.value.id}.{node.func.attr}()")
    return found


def test_distributed_keeps_no_module_state():
    bad = {}
    for f in sorted((ROOT / "distributed").glob("*.py")):
        tree = ast.parse(f.read_text())
        found = _mutations(tree, _mutable_globals(tree))
        if found:
            bad[f.name] = found
    assert not bad, f"module-level state changed at run time: {bad}"


def test_checker_sees_module_state():
    """The checker finds what it looks for (else the test above proves nothing)."""
    tree = ast.parse("_S: dict = {}\n_M = ['auto']\ndef f():\n    _S.update(a=1)\n    _M[0] = 'ring'\n")
    assert len(_mutations(tree, _mutable_globals(tree))) == 2


def test_library_sets_no_environment_variable():
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "setdefault", "update", "putenv") and "environ" in ast.unparse(node.func.value):
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Subscript) and "environ" in ast.unparse(t.value) for t in node.targets):
                line = f"{f.relative_to(ROOT)}:{node.lineno}"
                # the one place: train --nccl-nvls, set only when the user passes it
                if not (f.name == "train.py" and "NCCL_NVLS_ENABLE" in ast.unparse(node)):
                    bad.append(line)
    assert not bad, f"environment variables set by the library: {bad}"


def test_interpreter_mode_set_once_by_conftest():
    """The test suite sets TRITON_INTERPRET in one place (tests/conftest.py, before any test module
    imports a kernel module); no test module sets it again at import (a spawned rank or a
    subprocess may still set it for itself, inside a function)."""
    tests = pathlib.Path(__file__).resolve().parent
    bad = []
    for f in sorted(tests.glob("*.py")):
        if f.name == "conftest.py":
            continue
        for top in ast.parse(f.read_text()).body:
            if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if "TRITON_INTERPRET" in ast.unparse(top) and "environ" in ast.unparse(top):
                bad.append(f"{f.name}:{top.lineno}")
    assert not bad, f"TRITON_INTERPRET set again at import: {bad}"
