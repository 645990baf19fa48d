"""Structure facts of the code base, checked by `python tests/check_structure.py` (and by the test suite).

- no import loops between modules of `compressor/`, `calibration/`, `recipes/`, `benchmarks/` (imports inside
  functions count: a loop hidden in a function is still a loop);
- no file over 450 lines;
- no function over 80 lines, except pure option declarations (a function whose body is only `...` or a
  docstring, with its signature holding typer options);
- no block of six or more identical lines (ignoring blank lines and comments) shared between
  `compressor/remote_code/` and the rest of the package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compressor", "calibration", "recipes", "benchmarks")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
SHARED_BLOCK = 6


def source_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        base = ROOT / package
        # compressor/calibration and compressor/recipes may be links to the top-level folders: skip them.
        files += [p for p in sorted(base.rglob("*.py")) if not _through_link(p, base)]
    return files


def _through_link(path: Path, base: Path) -> bool:
    return any(parent.is_symlink() for parent in path.relative_to(base).parents if str(parent) != ".") or any(
        (base / part).is_symlink() for part in path.relative_to(base).parts[:-1]
    )


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


def import_loops(files: list[Path]) -> list[list[str]]:
    known = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, known) for p in files}
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


def problems() -> dict[str, list]:
    files = source_files()
    return {
        "import loops": [" -> ".join(loop) for loop in import_loops(files)],
        f"files over {MAX_FILE_LINES} lines": long_files(files),
        f"functions over {MAX_FUNCTION_LINES} lines": long_functions(files),
        f"blocks of {SHARED_BLOCK}+ lines repeated between remote_code/ and the library": shared_blocks(
            files
        ),
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
