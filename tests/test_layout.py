"""The package's shape holds: layers without upward imports or cycles, and small modules.

`lint-imports` (import-linter, contracts in pyproject.toml) checks the layers; a grimp graph checks for cycles. Both
are shown to catch what they are meant to catch on a copy of the package with one bad import added. Where private
internals may be used is checked over the AST in `tests/test_private_names.py`; that every probe module imports,
in `tests/_torch/test_probes.py`.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

import ampdoctor

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ampdoctor"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

ALLOWED_UPWARD: set[tuple[str, str]] = set()   # none: data reaches the UI only through core/views.py, by name

def _lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def find_cycles(graph: grimp.ImportGraph, ignore: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """Return the import cycles among ampdoctor's modules (strongly connected components of two or more)."""
    modules = sorted(m for m in graph.modules if m.startswith("ampdoctor"))
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m)
                       if n.startswith("ampdoctor") and (m, n) not in ignore) for m in modules}
    return [sorted(component) for component in _strongly_connected(modules, edges) if len(component) > 1]


def _strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Return the strongly connected components of a directed graph, in the order Tarjan's algorithm finds them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursive: the graph is small (about 60 modules)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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
            components.append(component)

    for v in nodes:
        if v not in index:
            visit(v)
    return components


def test_import_contracts_are_kept():
    result = _lint_imports(ROOT, ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "0 broken" in result.stdout


def test_there_are_no_import_cycles():
    assert find_cycles(grimp.build_graph("ampdoctor"), ignore=ALLOWED_UPWARD) == []


def test_the_cycle_check_finds_a_cycle_that_is_added():
    graph = grimp.build_graph("ampdoctor")
    graph.add_import(importer="ampdoctor.core.findings", imported="ampdoctor.core.report")  # report imports findings
    cycles = find_cycles(graph, ignore=ALLOWED_UPWARD)
    assert any({"ampdoctor.core.findings", "ampdoctor.core.report"} <= set(c) for c in cycles), cycles


def test_the_contracts_break_on_an_upward_import(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy / "ampdoctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    findings = copy / "ampdoctor" / "core" / "findings.py"
    findings.write_text(findings.read_text() + "\nfrom ampdoctor.runner import doctor  # an upward import\n")
    result = _lint_imports(tmp_path, copy)
    assert result.returncode != 0
    assert "ampdoctor.core.findings -> ampdoctor.runner.doctor" in result.stdout


def test_the_rooms_of_private_internals_import_only_what_their_contracts_allow(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy / "ampdoctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for module, line in (("_torch/optim.py", "from ampdoctor._compat import engines  # _torch stands alone"),
                         ("_compat/lightning.py", "from ampdoctor.core import dtypes  # _compat: only _torch")):
        path = copy / "ampdoctor" / module
        path.write_text(path.read_text() + f"\n{line}\n")
    result = _lint_imports(tmp_path, copy)
    assert result.returncode != 0
    assert "ampdoctor._torch.optim -> ampdoctor._compat.engines" in result.stdout
    assert "ampdoctor._compat.lightning -> ampdoctor.core.dtypes" in result.stdout


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def rich_imports(source: str) -> list[int]:
    """Return the lines of ``source`` that import rich, at any depth (inside a function too)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "rich" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rich":
            lines.append(node.lineno)
    return lines


def test_drawing_is_only_in_ui():
    # Runner and integrations print through one printer (core.views.printer, served by ui/plain.py): three of
    # them built their own rich console
    outside = {str(p.relative_to(SRC)): rich_imports(p.read_text()) for p in _modules() if "ui" not in
               p.relative_to(SRC).parts[:1]}
    assert {path: lines for path, lines in outside.items() if lines} == {}


def test_the_drawing_check_finds_a_rich_import_in_a_function():
    assert rich_imports("def show():\n    from rich.console import Console\n") == [2]
    assert rich_imports("import rich.text\nimport richer\n") == [1]


def test_ruff_keeps_functions_readable_and_lines_within_120_columns():
    # Size follows cohesion, not a line count: ruff's complexity (C901), branch (PLR0912) and statement (PLR0915)
    # limits keep each function readable in one screen; pyproject.toml's [tool.ruff] holds the rules.
    result = subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "--no-cache", "src", "tests",
                             "bench", "examples"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_the_ruff_check_fails_on_a_function_too_complex_to_read(tmp_path):
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(12))
    (tmp_path / "tangled.py").write_text(f"def tangled(x):\n{branches}\n    return -1\n")
    result = subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "--no-cache", "--config",
                             str(ROOT / "pyproject.toml"), str(tmp_path / "tangled.py")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "C901" in result.stdout, result.stdout


def test_no_module_is_named_like_a_public_function():
    public = {name for name in ampdoctor.__all__ if callable(getattr(ampdoctor, name)) and name[0].islower()}
    assert {"check", "explain", "fix", "watch"} <= public
    clashes = [str(p.relative_to(SRC)) for p in _modules() + [d for d in SRC.rglob("*") if d.is_dir()]
               if p.stem in public]
    assert clashes == []
