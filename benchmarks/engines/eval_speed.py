"""`eval --engine llama.cpp` against the transformers evaluation of the same model on the same windows.

The bundled model exported at each type (`--types`), then scored on the first `--max-tokens` tokens of the test
split: once in transformers (fp32), once per file in llama.cpp, each `masa-compress eval` a process of its own,
one after the other, alone on the machine. `--xllamacpp DIR` puts another build of llama.cpp's Python package
first on the path of the llama.cpp processes (`make llama-cpp-native` builds one for this CPU); `--build NAME`
names the rows it gives, so the prebuilt wheel's and a native build's rows sit side by side in one file:

    python -m benchmarks.engines.eval_speed --build prebuilt
    python -m benchmarks.engines.eval_speed --build native --xllamacpp /tmp/xllamacpp-native

Writes `benchmarks/results/eval-speed-smollm2-135m.json` (the build's rows replace that build's earlier ones).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.suite.common import command_line, log, machine_info, run_json_child, write_json

RESULTS = Path(__file__).resolve().parents[1] / "results" / "eval-speed-smollm2-135m.json"
MODEL = "smollm2-135m"
#: What each row keeps of `eval --json`.
KEPT = ("model", "engine", "ppl", "tokens", "windows", "seconds", "load_seconds")


def _env(xllamacpp: Path | None) -> dict[str, str]:
    """Our environment, with llama.cpp's package from `xllamacpp` first on the path where it is given."""
    env = dict(os.environ)
    if xllamacpp is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(xllamacpp), env.get("PYTHONPATH")) if p)
    return env


def _cli(args: list[str], xllamacpp: Path | None = None) -> dict:
    """`masa-compress ARGS --json` in a process of its own (llama.cpp's package from `xllamacpp` first, if given)."""
    return run_json_child(
        ["-m", "compressor", *args, "--json"], f"masa-compress {args[0]}", env=_env(xllamacpp)
    )


def llama_cpp_build(xllamacpp: Path | None) -> dict:
    """Which llama.cpp the llama.cpp rows ran: the package's location, version and the CPU features its build
    uses (llama.cpp's own system info)."""
    probe = (
        "import json, importlib.metadata as m, xllamacpp as x;"
        "print(json.dumps({'path': x.__file__, 'version': m.version('xllamacpp'),"
        " 'system_info': x.get_system_info()}))"
    )
    return run_json_child(["-c", probe], "the llama.cpp build probe", env=_env(xllamacpp))


def run(types: list[str], max_tokens: int, xllamacpp: Path | None, work: Path) -> dict:
    scored = ["--max-tokens", str(max_tokens), "--no-compare"]
    log(f"transformers: {MODEL}, first {max_tokens} test tokens")
    rows = {"transformers": _kept(_cli(["eval", MODEL, *scored]))}
    for gguf_type in types:
        path = work / f"bundled-{gguf_type}.gguf"
        _cli(["export", MODEL, str(path), "--type", gguf_type])
        log(f"llama.cpp: {path.name}")
        rows[gguf_type] = _kept(_cli(["eval", str(path), "--engine", "llama.cpp", *scored], xllamacpp))
    base = rows["transformers"]["seconds"]
    for row in rows.values():
        row["seconds_over_transformers"] = row["seconds"] / base
    return rows


def _kept(answer: dict) -> dict:
    return {key: answer[key] for key in KEPT}


def merged(previous: dict | None, build: str, entry: dict, machine: dict) -> dict:
    """The results file with `build`'s entry replaced (the other builds' kept: they ran on this machine too, or
    the file says on which)."""
    payload = dict(previous) if previous and "builds" in previous else {}
    payload["what"] = __doc__.splitlines()[0]
    payload["builds"] = {**payload.get("builds", {}), build: entry | {"machine": machine}}
    return payload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--build", default="prebuilt", help="the name of the llama.cpp build the rows measure"
    )
    parser.add_argument("--xllamacpp", type=Path, help="a folder holding another build of xllamacpp")
    parser.add_argument("--types", default="f16,q8_0,q4_k_m")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eval-speed-") as work:
        rows = run(args.types.split(","), args.max_tokens, args.xllamacpp, Path(work))
    entry = {
        "command": command_line("benchmarks.engines.eval_speed", argv),
        "date": time.strftime("%Y-%m-%d"),
        "llama_cpp": llama_cpp_build(args.xllamacpp),
        "max_tokens": args.max_tokens,
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    previous = json.loads(args.out.read_text()) if args.out.exists() else None
    write_json(args.out, merged(previous, args.build, entry, machine_info()))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
