"""The package's layers import only downward, and no module imports itself back through others.

Layers, from the bottom: ``errors``/``version`` < ``ir`` < ``rules`` (``rules/`` beside the package, installed
as ``onnxgrad.rules``) < ``passes`` < ``runtime`` < ``training`` < ``tools`` < the package's ``__init__`` and
``__main__``. Every import of an onnxgrad module, at the top of a file or inside a function, is read from
the source (``ast``), so a lazy import that climbs a layer or closes a circle fails here too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["errors", "version", "ir", "rules", "passes", "runtime", "training", "tools", "__init__", "__main__"]
RANK = {"errors": 0, "version": 0, "ir": 1, "rules": 2, "passes": 3, "runtime": 4, "training": 5, "tools": 6,
        "__init__": 7, "__main__": 8}


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "onnxgrad").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(p for p in parts if p != "__init__") or "onnxgrad"] = path
    for path in sorted((ROOT / "rules").rglob("*.py")):
        parts = ("onnxgrad",) + path.relative_to(ROOT).with_suffix("").parts
        files[".".join(p for p in parts if p != "__init__")] = path
    return files


FILES = _module_files()


def _imports(module: str, path: Path) -> set[str]:
    """The onnxgrad modules ``module`` imports (``from x import y``: x.y where that is a module, else x)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("onnxgrad")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("onnxgrad"):
                continue
            for a in node.names:
                out.add(f"{target}.{a.name}" if f"{target}.{a.name}" in FILES else target)
    out.discard(module)
    return {m for m in out if m in FILES}


IMPORTS = {m: _imports(m, p) for m, p in FILES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def test_every_module_has_a_layer():
    assert {_layer(m) for m in FILES} <= set(LAYERS), sorted({_layer(m) for m in FILES} - set(LAYERS))


@pytest.mark.parametrize("module", sorted(FILES))
def test_imports_only_go_down(module):
    up = sorted(m for m in IMPORTS[module] if RANK[_layer(m)] > RANK[_layer(module)])
    assert not up, f"{module} ({_layer(module)}) imports from a higher layer: {up}"


def test_no_import_circles():
    state: dict[str, int] = {}       # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(IMPORTS[m]):
            if n.startswith(m + "."):       # a package importing its own modules is not a circle
                continue
            if state.get(n) == 1 and not m.startswith(n + "."):
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(FILES):
        if m not in state:
            circle = visit(m)
            assert circle is None, " -> ".join(circle)


def test_the_checker_of_layers_can_fail():
    """The two checks above, on imports made up to break them: an upward import and a circle are found."""
    saved = {m: set(v) for m, v in IMPORTS.items()}
    try:
        IMPORTS["onnxgrad.ir.model"].add("onnxgrad.passes.autodiff")
        with pytest.raises(AssertionError, match="higher layer"):
            test_imports_only_go_down("onnxgrad.ir.model")
        with pytest.raises(AssertionError, match="onnxgrad.ir.model"):
            test_no_import_circles()
    finally:
        IMPORTS.clear()
        IMPORTS.update(saved)
