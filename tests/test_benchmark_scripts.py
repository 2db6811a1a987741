"""The benchmark scripts still name what exists: most of them need a GPU, so a renamed function they call can sit
unnoticed until a GPU session loses minutes to it (`kernel_sass.py --kernel cuda` called
`mla_decode_cuda._int_bits` for weeks after it was renamed). Without running them, this checks every name a
script takes from quantmla (`from quantmla.m import x`, `import quantmla.m as a` then `a.x`, `from quantmla.p
import m as a` then `a.x`) and from a sibling script (`from decode_kernel import x`)."""

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def missing_names(path: Path) -> list[str]:
    """'line: what' for every name the script takes from quantmla or a sibling script that is not there."""
    tree = ast.parse(path.read_text())
    modules, missing = {}, []  # local alias -> quantmla module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname: a.name for a in node.names if a.name.startswith("quantmla") and a.asname}
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        if node.module.startswith("quantmla"):
            parent = importlib.import_module(node.module)
            for a in node.names:
                try:
                    modules[a.asname or a.name] = importlib.import_module(f"{node.module}.{a.name}").__name__
                except ModuleNotFoundError:
                    if not hasattr(parent, a.name):
                        missing.append(f"{node.lineno}: from {node.module} import {a.name}")
        elif (BENCH / f"{node.module}.py").exists():
            have = _top_level_names(BENCH / f"{node.module}.py")
            missing += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name not in have]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if not hasattr(importlib.import_module(modules[node.value.id]), node.attr):
                missing.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return missing


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_names_exist(script):
    assert missing_names(script) == []


def test_a_renamed_name_is_caught(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("from quantmla.kernels import mla_decode_cuda as mdc\nfrom decode_kernel import bench, nope\n"
                    "from quantmla.kernels.mla_decode import mla_decode, gone\n\ndef f():\n    return mdc._int_bits\n")
    assert missing_names(fake) == ["2: from decode_kernel import nope",
                                   "3: from quantmla.kernels.mla_decode import gone", "6: mdc._int_bits"]
