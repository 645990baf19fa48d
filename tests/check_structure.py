"""Structure facts of the code base, checked by `python tests/check_structure.py` (and by the test suite).

- no import loops between modules of `compressor/`, `calibration/`, `recipes/`, `benchmarks/` (imports inside
  functions count: a loop hidden in a function is still a loop);
- the package's floors (`FLOORS`): a module imports from its own subpackage or from a floor below, never up;
- `compressor/` holds at most 11 entries (besides `__init__.py`, `__main__.py`), `benchmarks/` at most 12 modules
  at its top (laid out by role in subpackages), and the repository no symlink;
- `calibration` and `recipes` imported only as `compressor.calibration` / `compressor.recipes` (one import path);
- no file over 450 lines;
- no function over 80 lines, except pure option declarations (a function whose body is only `...` or a
  docstring, with its signature holding typer options);
- no block of six or more identical lines (ignoring blank lines and comments) shared between
  `compressor/modeling/remote_code/` and the rest of the package;
- no module path of a model family in the library outside its registry (`compressor/modeling/families.py`; the
  checkpoint's remote code carries its own documented copy): no `.self_attn` / `.qkv_proj` / `.gate_up_proj`
  attribute, no `.mlp` of a layer (`layer.mlp`, `layers[i].mlp`), no `model.model.layers`, no string holding a
  dotted path through those (`"model.layers."`, `"self_attn"`, `"mlp.down_proj"`). Docstrings and comments may
  name them.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compressor", "calibration", "recipes", "benchmarks")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
SHARED_BLOCK = 6


#: 11 since quantization (llama.cpp's types, the importance, the byte budget) became a stage of its own.
MAX_TOP_ENTRIES = 11
MAX_BENCHMARK_MODULES = 12
#: The floors of the package, bottom first. A module may import its own subpackage's modules and anything on a
#: lower floor; packages on one floor do not import each other. `compressor` is the root's face (`__version__`,
#: the moved-module aliases), importing nothing of the package.
FLOORS = (
    ("compressor", "compressor.runtime"),
    ("compressor.modeling",),
    ("compressor.recipes", "compressor.calibration"),
    ("compressor.math", "compressor.evaluation"),
    ("compressor.statistics",),
    ("compressor.quantize",),
    ("compressor.checkpoint", "compressor.report"),
    ("compressor.methods",),
    ("compressor.api",),
    ("compressor.cli",),
    ("compressor.__main__",),
    ("benchmarks",),
)
#: Folders of the checkout that are not the project's own files.
NOT_OURS = {".git", ".venv", ".venv-vllm", "out", "build", ".pytest_cache", ".ruff_cache", "__pycache__"}


def source_files() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("calibration", "recipes"):  # installed as compressor.calibration / compressor.recipes
        parts.insert(0, "compressor")
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (read once; loops and floors are both checked on it)."""
    known = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, known) for p in files}


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    # A package's __init__ is imported by everything below it; edges *to* a package face do not make loops
    # of their own, so only module → module edges are followed.
    loops, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                loops.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return loops


def floor_of(module: str) -> tuple[int, str]:
    """(floor, package) of a module: its first-level subpackage of `compressor`, or `benchmarks`."""
    parts = module.split(".")
    package = parts[0] if parts[0] != "compressor" else ".".join(parts[:2])
    for floor, packages in enumerate(FLOORS):
        if package in packages:
            return floor, package
    raise KeyError(f"{module}: its package {package} is on no floor of FLOORS (tests/check_structure.py)")


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up the floors, or sideways into another package of the same floor."""
    found = []
    for name, targets in graph.items():
        floor, package = floor_of(name)
        for target in sorted(targets):
            target_floor, target_package = floor_of(target)
            if target_package != package and target_floor >= floor:
                found.append(f"{name} -> {target}")
    return found


def top_entries() -> list[str]:
    """The entries of `compressor/` beyond `MAX_TOP_ENTRIES`, when there are too many (all of them then)."""
    entries = sorted(
        p.name
        for p in (ROOT / "compressor").iterdir()
        if p.name not in ("__init__.py", "__main__.py", "__pycache__")
    )
    return entries if len(entries) > MAX_TOP_ENTRIES else []


def benchmark_top_modules() -> list[str]:
    """The modules at the top of `benchmarks/`, when there are more than `MAX_BENCHMARK_MODULES` (all of them)."""
    modules = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    return modules if len(modules) > MAX_BENCHMARK_MODULES else []


def symlinks() -> list[str]:
    found = []
    for path in sorted(ROOT.iterdir()):
        if path.name in NOT_OURS:
            continue
        candidates = [path] + (sorted(path.rglob("*")) if path.is_dir() and not path.is_symlink() else [])
        found += [
            str(c.relative_to(ROOT)) for c in candidates if c.is_symlink() and not NOT_OURS & set(c.parts)
        ]
    return found


def bare_imports(files: list[Path]) -> list[str]:
    """`import calibration` / `from recipes import ...`: a second import path to modules of the package."""
    found = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [
                f"{p.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("calibration", "recipes")
            ]
    return found


def long_files(files: list[Path]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]


def _is_option_declaration(node: ast.FunctionDef) -> bool:
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body:
        return True
    # A typer command: long only because of its Annotated[...] option declarations; the body is short.
    body_lines = body[-1].end_lineno - body[0].lineno + 1
    return body_lines <= MAX_FUNCTION_LINES // 2 and "typer" in ast.unparse(node.args)


def long_functions(files: list[Path]) -> list[str]:
    found = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not _is_option_declaration(node):
                    found.append(f"{p.relative_to(ROOT)}:{node.name}: {length} lines")
    return found


def _code_lines(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def shared_blocks(files: list[Path]) -> list[str]:
    remote = [p for p in files if "remote_code" in p.parts]
    library = [p for p in files if p.parts[len(ROOT.parts)] == "compressor" and "remote_code" not in p.parts]
    windows: dict[tuple[str, ...], str] = {}
    for p in library:
        lines = _code_lines(p)
        for i in range(len(lines) - SHARED_BLOCK + 1):
            windows.setdefault(tuple(lines[i : i + SHARED_BLOCK]), str(p.relative_to(ROOT)))
    found = []
    for p in remote:
        lines = _code_lines(p)
        for i in range(len(lines) - SHARED_BLOCK + 1):
            where = windows.get(tuple(lines[i : i + SHARED_BLOCK]))
            if where:
                found.append(f"{p.relative_to(ROOT)} line {i + 1} (code lines) repeats {where}")
                break
    return found


#: Where the library may write a family's module paths: the registry, and the remote code's copy.
FAMILY_REGISTRY = ("compressor/modeling/families.py", "compressor/modeling/remote_code/")
#: Modules no code outside the registry names as an attribute.
FAMILY_MODULES = {"self_attn", "qkv_proj", "gate_up_proj", "block_sparse_moe"}
#: A string naming one of them, or a dotted path through a layer's MLP or the decoder's layers.
FAMILY_PATH = re.compile(
    r"\b(self_attn|qkv_proj|gate_up_proj|block_sparse_moe)\b|\bmlp\.(\w|$)|\bmodel\.layers\b"
)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                found.add(id(body[0].value))
    return found


def _names_a_family_path(node: ast.AST, docstrings: set[int]) -> bool:
    if isinstance(node, ast.Attribute):
        if node.attr in FAMILY_MODULES:
            return True
        layer = isinstance(node.value, ast.Subscript) or (
            isinstance(node.value, ast.Name) and node.value.id == "layer"
        )
        if node.attr == "mlp" and layer:  # a decoder layer's MLP
            return True
        if node.attr == "layers" and isinstance(node.value, ast.Attribute) and node.value.attr == "model":
            return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        return bool(FAMILY_PATH.search(node.value))
    return False


def family_paths(files: list[Path]) -> list[str]:
    """Module paths of a model family written outside the registry (see the module docstring)."""
    found = []
    for p in files:
        relative = str(p.relative_to(ROOT))
        if not relative.startswith("compressor/") or relative.startswith(FAMILY_REGISTRY):
            continue
        tree = ast.parse(p.read_text())
        docstrings = _docstrings(tree)
        found += [
            f"{relative}:{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(tree)
            if _names_a_family_path(node, docstrings)
        ]
    return found


def problems() -> dict[str, list]:
    files = source_files()
    graph = import_graph(files)
    return {
        "import loops": [" -> ".join(loop) for loop in import_loops(graph)],
        "imports up the floors or across one": imports_up(graph),
        f"entries of compressor/ (at most {MAX_TOP_ENTRIES})": top_entries(),
        f"modules at the top of benchmarks/ (at most {MAX_BENCHMARK_MODULES})": benchmark_top_modules(),
        "symlinks": symlinks(),
        "bare imports of calibration/ or recipes/": bare_imports(files),
        f"files over {MAX_FILE_LINES} lines": long_files(files),
        f"functions over {MAX_FUNCTION_LINES} lines": long_functions(files),
        f"blocks of {SHARED_BLOCK}+ lines repeated between remote_code/ and the library": shared_blocks(
            files
        ),
        "module paths of a model family outside compressor/modeling/families.py": family_paths(files),
    }


def main() -> int:
    found = problems()
    for what, items in found.items():
        print(f"{what}: {'none' if not items else len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
