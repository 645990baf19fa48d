"""`eval --engine llama.cpp` against the transformers evaluation of the same model on the same windows.

The bundled model exported at each type (`--types`), then scored on the first `--max-tokens` tokens of the test
split: once in transformers (fp32), once per file in llama.cpp, each `masa-compress eval` a process of its own,
one after the other, alone on the machine. `--xllamacpp DIR` puts another build of llama.cpp's Python package
first on the path of the llama.cpp processes (`make llama-cpp-native` builds one for this CPU); `--build NAME`
names the rows it gives, so the prebuilt wheel's and a native build's rows sit side by side in one file:

    python -m benchmarks.engines.eval_speed --build prebuilt
    make llama-cpp-native LLAMA_CPP_NATIVE_INTO=/tmp/xllamacpp-native
    python -m benchmarks.engines.eval_speed --build native --xllamacpp /tmp/xllamacpp-native

The `native` rows are that build: this CPU's vectors and its AMX tiles (the Makefile applies the fix proposed
upstream for llama.cpp's AMX fault, `llama-cpp-amx.patch` here). The `native-openblas` rows: an earlier native
build, with AMX off (the Makefile's flags before the fix) and llama.cpp's BLAS backend on (`-DGGML_BLAS=ON
-DGGML_BLAS_VENDOR=OpenBLAS` added; Debian's libopenblas-dev). xllamacpp's setup links
that backend only if its library exists before the build starts, so it takes two `pip install --target DIR .` from
one unpacked source folder (`pip download --no-binary :all: xllamacpp==VERSION`): the second links it, and the
build probe lists a `BLAS (OpenBLAS)` device.

Each file is scored twice: as `eval` scores it by default (exact), and with `--flash-attention` (rows `TYPE flash`:
llama.cpp's CPU flash attention, faster and not exact; their perplexity beside the exact row's says what it
changes).

Beside the rows, where one evaluation's time goes (`window`, the f16 file, one 512-token window, the median of
`WINDOW_REPEATS`): the hidden states of every position, what `eval` asks llama.cpp for, against the prefill of the
same window with logits for its last position only (llama.cpp's own timing). In embedding mode llama.cpp still
applies the output matrix at every position (its graph always ends with the logits), and `eval` cannot use those
logits (a window's would be 100 MB of JSON): it applies the matrix again in torch. So the difference is that head
plus the states' transfer; the prefill alone is the rest, llama.cpp's own kernels.

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
#: The suffix of a row scored with `eval --flash-attention` (llama.cpp's flash attention: faster, not exact).
FLASH = " flash"
#: The window the breakdown times, and how often (the median is kept).
WINDOW_TOKENS, WINDOW_REPEATS = 512, 5
#: Run in a child with the build's environment: `WINDOW_REPEATS` timings of each request for one window.
WINDOW_PROBE = """
import json, statistics, sys, time
from compressor.evaluation.llama_cpp import LlamaCppServer
path, tokens, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
scoring = LlamaCppServer(path, tokens, threads)
serving = LlamaCppServer(path, tokens, threads, embedding=False)  # as a server that only generates
ids = [(7919 * i) % 40000 + 100 for i in range(tokens)]
states, prefill = [], []
for _ in range(repeats):
    start = time.perf_counter()
    scoring.hidden_states(ids)
    states.append(time.perf_counter() - start)
    prefill.append(serving.complete(ids[:-1], 1)["timings"]["prompt_ms"] / 1000)
print(json.dumps({"tokens": tokens, "repeats": repeats, "threads": threads,
                  "hidden_states_seconds": statistics.median(states),
                  "prefill_seconds": statistics.median(prefill)}))
"""


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
        " 'system_info': x.get_system_info(),"
        " 'devices': [f\"{d['name']} ({d['description']})\" for d in x.get_device_info()]}))"
    )
    return run_json_child(["-c", probe], "the llama.cpp build probe", env=_env(xllamacpp))


def window_timings(path: Path, xllamacpp: Path | None, threads: int) -> dict:
    """One window's hidden states (what `eval` reads) against its prefill alone, in llama.cpp (module doc)."""
    args = ["-c", WINDOW_PROBE, str(path), str(WINDOW_TOKENS), str(WINDOW_REPEATS), str(threads)]
    return run_json_child(args, "the window timing probe", env=_env(xllamacpp))


def run(types: list[str], max_tokens: int, xllamacpp: Path | None, work: Path) -> tuple[dict, dict | None]:
    """The rows (transformers, then each type's file in llama.cpp) and the f16 file's window breakdown."""
    scored = ["--max-tokens", str(max_tokens), "--no-compare"]
    log(f"transformers: {MODEL}, first {max_tokens} test tokens")
    rows = {"transformers": _kept(_cli(["eval", MODEL, *scored]))}
    for gguf_type in types:
        path = work / f"bundled-{gguf_type}.gguf"
        _cli(["export", MODEL, str(path), "--type", gguf_type])
        log(f"llama.cpp: {path.name}")
        rows[gguf_type] = _kept(_cli(["eval", str(path), "--engine", "llama.cpp", *scored], xllamacpp))
        log(f"llama.cpp: {path.name}, flash attention")
        fast = ["eval", str(path), "--engine", "llama.cpp", "--flash-attention", *scored]
        rows[f"{gguf_type}{FLASH}"] = _kept(_cli(fast, xllamacpp))
    base = rows["transformers"]["seconds"]
    for row in rows.values():
        row["seconds_over_transformers"] = row["seconds"] / base
    window = None
    if "f16" in types:
        log(f"llama.cpp: one {WINDOW_TOKENS}-token window, hidden states against prefill alone")
        window = window_timings(work / "bundled-f16.gguf", xllamacpp, os.cpu_count() or 1)
    return rows, window


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
        rows, window = run(args.types.split(","), args.max_tokens, args.xllamacpp, Path(work))
    entry = {
        "command": command_line("benchmarks.engines.eval_speed", argv),
        "date": time.strftime("%Y-%m-%d"),
        "llama_cpp": llama_cpp_build(args.xllamacpp),
        "max_tokens": args.max_tokens,
        "rows": rows,
        "window": window,
        "seconds": round(time.perf_counter() - start, 1),
    }
    previous = json.loads(args.out.read_text()) if args.out.exists() else None
    write_json(args.out, merged(previous, args.build, entry, machine_info()))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
