"""The package's structure, read statically from the source: modules of at most `MAX_LINES` lines, no import cycle
among `attnres_hf` modules, and remote-code files (`modeling/`) that import only torch, transformers, the standard
library and each other."""

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 500
REMOTE_CODE = SRC / "attnres_hf" / "modeling"
REMOTE_CODE_IMPORTS = {"torch", "transformers", "huggingface_hub"}
"""Top-level packages the remote-code files may import besides the standard library and their siblings
(`huggingface_hub`: a dependency of transformers, installed wherever it is)."""
OPTIONAL_LAZY_IMPORTS = {"attnres_fla.py": {"fla.ops.attnres"}}
"""The one optional dependency of remote code: `attnres_implementation="fla"` runs flash-linear-attention's fused
kernel, which only that config needs and only on CUDA. It is imported inside a function (a checkpoint must load, and
run with "torch", where fla is not installed) and inside its `try` (transformers' remote-code loader requires every
package a file imports to be installed, except the imports in `try` blocks: `_guarded_lazy_imports`)."""


OPTIONAL_MODULES = {"attnres_kernels.py": {"triton", "triton.language", "triton.runtime.interpreter"}}
"""Remote-code files that exist for an optional dependency (`attnres_implementation="triton"`'s kernels): they import
it at module level inside a `try` (Triton's kernels are module-level `@triton.jit` functions), and their siblings
import them only inside a function's `try` (`test_optional_modules_are_imported_lazily`), so a checkpoint loads, and
runs with "torch", where Triton is not installed."""


def _try_imports(path: Path) -> set[int]:
    """Lines of the import statements in `path` inside a module-level `try` block's body."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {node.lineno for block in tree.body if isinstance(block, ast.Try) for statement in block.body
            for node in ast.walk(statement) if isinstance(node, (ast.Import, ast.ImportFrom))}


def find_modules(src: Path, package: str) -> dict[str, Path]:
    """`{module name: file}` of every module of `package` under `src`; a package is its `__init__.py`."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path) -> list[tuple[int, int, str | None, tuple[str, ...]]]:
    """`(line, level, module, names)` of every import statement in `path`, at module level or inside functions and
    classes (a lazy import is an import too): `import a.b` is `(line, 0, "a.b", ())`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, 0, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module, tuple(alias.name for alias in node.names)))
    return found


def _guarded_lazy_imports(path: Path) -> set[int]:
    """Lines of the import statements in `path` that are inside a function and inside a `try` block's body."""
    lines = set()
    for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for block in ast.walk(function):
                if isinstance(block, ast.Try):
                    lines |= {node.lineno for statement in block.body for node in ast.walk(statement)
                              if isinstance(node, (ast.Import, ast.ImportFrom))}
    return lines


def _package_of(modules: dict[str, Path], name: str) -> str:
    """The package a module's relative imports start from: itself for a package `__init__`, else its parent."""
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def _targets(modules: dict[str, Path], importer: str, level: int, module: str | None,
             names: tuple[str, ...]) -> set[str]:
    """The modules of `modules` that one import statement in `importer` runs.

    - The module imported: for `from pkg import name`, the submodule `pkg.name` where there is one, else (any other
      name, `*`) the package's `__init__`; `import pkg` is the package's `__init__` too.
    - The `__init__` of every package above it that does not also contain the importer: Python runs those first
      (`from ..eval.offline import x` runs `eval/__init__.py`), while the importer's own packages are already being
      imported. So a package `__init__` importing its own submodules is an ordinary edge; with it, a submodule that
      imports a name from its own package (`from . import name`, `from .. import name`: an edge to that `__init__`)
      closes a cycle, a real one: the submodule's import then runs the `__init__`, which imports the submodule.
    """
    base = module
    if level:
        parts = _package_of(modules, importer).split(".")
        base = ".".join(parts[: len(parts) - (level - 1)] + ([module] if module else []))
    imported = {f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names} if names else {base}
    known = set()
    for name in imported:  # the longest prefix that is a module of the package (None: another package)
        parts = name.split(".")
        known |= {next((p for p in (".".join(parts[:end]) for end in range(len(parts), 0, -1)) if p in modules), None)}
    known.discard(None)
    own = _package_of(modules, importer).split(".")
    containing = {".".join(own[:end]) for end in range(1, len(own) + 1)}
    targets = set(known)
    for target in known:
        parts = target.split(".")
        targets |= {".".join(parts[:end]) for end in range(1, len(parts))} - containing
    targets.discard(importer)
    return targets


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """`{importer: {imported module: line of the first import statement that runs it}}` over `modules`."""
    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, level, module, names in _imports(path):
            for target in _targets(modules, name, level, module, names):
                edges.setdefault(target, line)
    return graph


def import_components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module, each sorted (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """The shortest cycle `[a, b, ..., a]` through the first module of `component` (breadth-first)."""
    start, members = component[0], set(component)
    parents, frontier, end = {start: None}, [start], None
    while frontier and end is None:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    end = node
                    break
                if target in members and target not in parents:
                    parents[target] = node
                    following.append(target)
            if end is not None:
                break
        frontier = following
    path = []
    while end is not None:
        path.append(end)
        end = parents[end]
    return [*reversed(path), start]


def describe_cycles(modules: dict[str, Path], src: Path) -> str:
    """One paragraph per import cycle (its modules, and one cycle through them with the import lines), or ''."""
    graph = import_graph(modules)
    described = []
    for component in import_components(graph):
        cycle = shortest_cycle(graph, component)
        steps = [f"    {a} -> {b}  ({modules[a].relative_to(src)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        described.append(f"  modules in a cycle: {', '.join(component)}\n  e.g. {' -> '.join(cycle)}\n"
                         + "\n".join(steps))
    return "\n".join(described)


def test_no_module_is_over_the_line_limit():
    """Every module under src/ has at most `MAX_LINES` lines, counted as `wc -l` does (newline characters)."""
    lines = {path: path.read_bytes().count(b"\n") for path in sorted(SRC.rglob("*.py"))}
    too_long = {path: count for path, count in lines.items() if count > MAX_LINES}
    if too_long:
        pytest.fail(f"{len(too_long)} module(s) over {MAX_LINES} lines; split them by job:\n" + "\n".join(
            f"  {path.relative_to(SRC.parent)}: {count} lines" for path, count in too_long.items()), pytrace=False)


def test_no_import_cycle():
    """No cycle among `attnres_hf` modules, counting every import: module-level and lazy (inside functions),
    relative ones resolved, and the package `__init__` files each import runs (see `_targets`)."""
    modules = find_modules(SRC, "attnres_hf")
    assert "attnres_hf.modeling.backbones" in modules and "attnres_hf.eval" in modules
    cycles = describe_cycles(modules, SRC)
    if cycles:
        pytest.fail(f"import cycles among attnres_hf modules:\n{cycles}", pytrace=False)


def test_the_cycle_check_sees_lazy_package_and_parent_imports(tmp_path):
    """On a made-up package: a cycle through a lazy import, a submodule importing a name from its own package, a
    module whose import runs another package's `__init__` that imports it back; and none from re-exports, `from .
    import submodule` or a package importing a name from its own submodule."""
    files = {
        "__init__.py": "from .a import f\nfrom . import d\n",
        "a.py": "def f():\n    from .b import g\n    return g\n",  # lazy: a -> b
        "b.py": "from .a import f as g\n",  # b -> a
        "sub/__init__.py": "from .c import x\n",  # a re-export: sub -> sub.c
        "sub/c.py": "x = 1\n\n\ndef y():\n    from . import x as z\n    return z\n",  # sub.c -> sub (a name of sub)
        "d.py": "import os\n\nfrom . import a\nfrom .sub import c\n",  # submodules: d -> a, d -> sub.c, d -> sub
        "f.py": "from .g.h import w\n",  # runs g/__init__: f -> g.h, f -> g
        "g/__init__.py": "from ..f import w\n",  # g -> f
        "g/h.py": "w = 2\n",
        "k/__init__.py": "from .m import v\n",
        "k/m.py": "v = 3\n",
        "k/n.py": "from .m import v\nfrom ..k import m\n",  # n -> k.m only: no cycle with k
    }
    for name, text in files.items():
        (tmp_path / "toy" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "toy" / name).write_text(text)
    modules = find_modules(tmp_path, "toy")
    graph = import_graph(modules)
    assert graph["toy.d"] == {"toy.a": 3, "toy.sub.c": 4, "toy.sub": 4}
    assert graph["toy.f"] == {"toy.g.h": 1, "toy.g": 1} and graph["toy.k.n"] == {"toy.k.m": 1}
    assert import_components(graph) == [["toy.a", "toy.b"], ["toy.f", "toy.g"], ["toy.sub", "toy.sub.c"]]
    assert shortest_cycle(graph, ["toy.a", "toy.b"]) == ["toy.a", "toy.b", "toy.a"]
    assert "toy.f -> toy.g  (toy/f.py:1)" in describe_cycles(modules, tmp_path)


@pytest.mark.parametrize("path", sorted(REMOTE_CODE.glob("*.py")), ids=lambda path: path.name)
def test_remote_code_imports_only_torch_transformers_and_siblings(path):
    """The modeling files travel with checkpoints as flat remote code (`auto_map`): they may import torch,
    transformers, the standard library and their sibling files (relative, one dot), nothing else of attnres_hf and
    no other package (matplotlib, lm_eval, ...), also not inside a function, but for `OPTIONAL_LAZY_IMPORTS`; and
    transformers' remote-code loader requires no other package installed for them."""
    siblings = {p.stem for p in REMOTE_CODE.glob("*.py")}
    optional, guarded = OPTIONAL_LAZY_IMPORTS.get(path.name, set()), _guarded_lazy_imports(path)
    module_level, tried = OPTIONAL_MODULES.get(path.name, set()), _try_imports(path)
    bad = []
    for line, level, module, names in _imports(path):
        if level == 0:
            if (module in optional and line in guarded) or (module in module_level and line in tried):
                continue
            top = module.split(".")[0]
            if top not in REMOTE_CODE_IMPORTS and top not in sys.stdlib_module_names:
                bad.append(f"line {line}: import of {module}")
            continue
        sibling = module in siblings if module else set(names) <= siblings
        if level > 1 or not sibling:
            shown = "." * level + (module or "")
            bad.append(f"line {line}: from {shown} import {', '.join(names)} (not a sibling modeling file)")
    if bad:
        pytest.fail(f"{path.relative_to(SRC)} imports what remote code cannot:\n" + "\n".join(bad), pytrace=False)
    from transformers.dynamic_module_utils import get_imports  # what the remote-code loader requires installed

    assert set(get_imports(path)) <= REMOTE_CODE_IMPORTS | set(sys.stdlib_module_names), get_imports(path)


def test_optional_modules_are_imported_lazily():
    """Every sibling's import of an `OPTIONAL_MODULES` file is inside a function's `try`."""
    for path in sorted(REMOTE_CODE.glob("*.py")):
        guarded = _guarded_lazy_imports(path)
        for line, level, module, names in _imports(path):
            imported = {f"{name}.py" for name in names} if level == 1 and module is None else {f"{module}.py"}
            if level == 1 and imported & OPTIONAL_MODULES.keys():
                assert line in guarded, f"{path.name}:{line} imports {imported} outside a function's try"


def test_the_optional_fla_import_is_lazy_and_guarded(tmp_path):
    """The `fla` import of `attnres_fla.py` is allowed only inside a function's `try`: at module level, or in a
    function without the `try`, it is refused (and the remote-code loader would require fla)."""
    from transformers.dynamic_module_utils import get_imports

    path = REMOTE_CODE / "attnres_fla.py"
    lines = [line for line, _, module, _ in _imports(path) if module in OPTIONAL_LAZY_IMPORTS[path.name]]
    assert lines and set(lines) <= _guarded_lazy_imports(path) and "fla" not in get_imports(path)
    unguarded = tmp_path / "attnres_fla.py"
    unguarded.write_text("from fla.ops.attnres import fused_attnres\n\n\ndef f():\n    from fla.ops.attnres import "
                         "naive_attnres\n    try:\n        import fla.ops.attnres\n    except ImportError:\n"
                         "        pass\n")
    assert _guarded_lazy_imports(unguarded) == {7} and "fla" in get_imports(unguarded)
