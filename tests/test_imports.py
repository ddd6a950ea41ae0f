"""No import circle in cpvlm: the graph of which module imports which has no cycle.

Every module under ``cpvlm/`` is parsed with ``ast`` (nothing is imported). A module has an edge to
each cpvlm module that one of its import statements loads:

- imports inside functions count too: a lazy import only postpones a circle (the two modules still
  need each other), so a circle is broken by moving the shared piece to a module both import.
  Imports under ``if TYPE_CHECKING:`` are left out: they never run;
- relative imports are resolved to module names; ``from a.b import c`` leads to ``a.b.c`` where
  that is a module, else to ``a.b`` (its ``__init__``, which must already bind ``c``);
- importing ``a.b.c`` also loads the ``__init__`` of ``a`` and ``a.b``, except where one is the
  importer's own package (or above it): that one is mid-import already and nothing is read from
  it. So a package's ``__init__`` re-exporting its submodules is no circle, but a submodule that
  takes a name from its own package's ``__init__`` (``from cpvlm.distributed import PAD_DOC``
  inside ``cpvlm.distributed``) is one: it works only if the ``__init__`` got that far.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes):
    """The import statements in ``nodes`` and below, but those under ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: the modules its imports load}`` for the package ``root / package``."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph = {name: set() for name in files}
    for name, path in files.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:
                up = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in files else base)
        for target in targets:
            parts = target.split(".")
            run = {target} | {".".join(parts[:i]) for i in range(1, len(parts))}
            # The importer's own packages are mid-import: only an explicit target counts.
            run -= {p for p in run - {target} if (own_package + ".").startswith(p + ".")}
            graph[name] |= {m for m in run if m in files and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_cpvlm_has_no_import_cycle():
    graph = import_graph(ROOT, "cpvlm")
    assert len(graph) > 100 and graph["cpvlm"]  # the walk found the modules and their imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_planted_cycle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "sub" / "b.py").write_text("from ..c import C\nB = 1\n")
    (pkg / "c.py").write_text("C = 1\n\ndef lazy():\n    from pkg.sub import B\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg\n"
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.c"}  # its own packages are mid-import
    assert graph["pkg.d"] == set()  # annotations only
    assert find_cycle(graph) == ["pkg.sub", "pkg.sub.b", "pkg.c", "pkg.sub"]
    (pkg / "c.py").write_text("C = 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_hf_public_names_load_lazily():
    """``cpvlm.hf``'s public names load on first use: its ``__init__`` loads no CP-step module
    (that would close a circle through the families), and every exported name resolves."""
    import subprocess
    import sys

    code = (
        "import sys, cpvlm.hf as h\n"
        "assert 'cpvlm.hf.context_parallel' not in sys.modules\n"
        "assert sorted(h.__all__) == sorted(h._EXPORTS)\n"
        "for n in h.__all__: getattr(h, n)\n"
        "assert 'cpvlm.hf.context_parallel' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
