"""BENCHMARKS.md section 7's line on `eval --engine llama.cpp` against transformers, per llama.cpp build."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.engines.eval_speed import FLASH
from benchmarks.suite.common import machine_signature


def eval_speed_lines(results: Path) -> list[str]:
    """`eval --engine llama.cpp` against transformers on the same windows, per llama.cpp build
    (`benchmarks/engines/eval_speed.py`): the frontier scores dozens of files in llama.cpp."""
    path = results / "eval-speed-smollm2-135m.json"
    if not path.is_file():
        return []
    builds = json.loads(path.read_text())["builds"]
    said = []
    for name, build in builds.items():
        rows = build["rows"]
        files = ", ".join(
            f"{kind} {row['seconds_over_transformers']:.2f}x{_flash(rows, kind)}"
            for kind, row in rows.items()
            if kind != "transformers" and not kind.endswith(FLASH)
        )
        features = [part.split(" = ")[0].strip() for part in build["llama_cpp"]["system_info"].split("|")]
        widest = next((f for f in ("AVX512", "AVX2", "AVX") if f in features), "no AVX")
        amx = ["AMX"] if "AMX_INT8" in features else []
        blas = [d for d in build["llama_cpp"].get("devices", []) if d.startswith("BLAS")]
        kind = ", ".join([widest, *amx, *(f"matrix products through {d}" for d in blas)])
        said.append(
            f"{name} ({kind}; transformers {rows['transformers']['seconds']:.1f} s): {files} the transformers "
            f"time{_window_breakdown(build)}"
        )
    first = next(iter(builds.values()))
    return [
        f"**Evaluating in llama.cpp** (`eval --engine llama.cpp`, the bundled model's first {first['max_tokens']:,} "
        f"test tokens, each file in a process of its own, on {machine_signature(first['machine'])}; "
        "`python -m benchmarks.engines.eval_speed`): "
        + "; ".join(said)
        + ". The prebuilt wheel is built for AVX2 and uses no wider vectors; `make llama-cpp-native` builds it "
        "from source for the machine it runs on, AMX included (with the fix proposed upstream, "
        "`benchmarks/engines/llama-cpp-amx.patch`: llama.cpp's integer tile products, which quantized types such as "
        "q8_0 take). The hidden states cost more than the prefill because llama.cpp "
        "applies the output matrix at every position in embedding mode, logits `eval` cannot take from it, and "
        "`eval` applies it again in torch; the prefill alone is llama.cpp's own kernels "
        "([eval_speed](benchmarks/engines/eval_speed.py)).",
        "",
    ]


def _flash(rows: dict, kind: str) -> str:
    """The same file scored with `--flash-attention` ('' if it was not): its time and its perplexity's change."""
    fast = rows.get(kind + FLASH)
    if fast is None:
        return ""
    change = fast["ppl"] - rows[kind]["ppl"]
    return f" ({fast['seconds_over_transformers']:.2f}x with `--flash-attention`, perplexity {change:+.4f})"


def _window_breakdown(build: dict) -> str:
    """Where one f16 window's time goes in llama.cpp, against transformers' time per window ('' if not timed)."""
    window = build.get("window")
    if not window:
        return ""
    transformers = build["rows"]["transformers"]
    return (
        f"; one {window['tokens']}-token window of the f16 file: its hidden states "
        f"{window['hidden_states_seconds']:.2f} s, its prefill alone {window['prefill_seconds']:.2f} s "
        f"(transformers {transformers['seconds'] / transformers['windows']:.2f} s a window, head included)"
    )


def llama_cpp_eval_limitation(results_dir: Path) -> str:
    """The README's limitation line: `eval --engine llama.cpp` against transformers on the same windows, per
    build (`eval-speed-*.json`)."""
    path = results_dir / "eval-speed-smollm2-135m.json"
    if not path.is_file():
        return ""
    builds = json.loads(path.read_text())["builds"]

    def span(build: dict) -> str:
        """The exact rows' range of times over transformers', the `--flash-attention` rows' beside it if any."""
        ranges = {True: [], False: []}
        for kind, row in build["rows"].items():
            if kind != "transformers":
                ranges[kind.endswith(FLASH)].append(row["seconds_over_transformers"])
        exact, fast = ranges[False], ranges[True]
        flash = f" ({min(fast):.1f}-{max(fast):.1f}x with `--flash-attention`)" if fast else ""
        return f"{min(exact):.1f}-{max(exact):.1f}x{flash}"

    def amx(build: dict) -> str:
        return ", AMX included" if "AMX_INT8" in build["llama_cpp"]["system_info"] else ""

    native = (
        f", {span(builds['native'])} with llama.cpp built for it{amx(builds['native'])} (`make llama-cpp-native`)"
        if "native" in builds
        else ""
    )
    openblas = (
        f", {span(builds['native-openblas'])} with OpenBLAS doing its matrix products"
        + ("" if "AMX_INT8" in builds["native-openblas"]["llama_cpp"]["system_info"] else " (AMX off)")
        if "native-openblas" in builds
        else ""
    )
    machine = builds["prebuilt"]["machine"]
    return (
        "- **Scoring a GGUF in llama.cpp is slower than in transformers** (`eval --engine llama.cpp`, the bundled "
        f"model on the same windows, a {machine['usable_cores']}-core {machine['vector_extension']} CPU): "
        f"{span(builds['prebuilt'])} the transformers time with "
        f"the prebuilt AVX2 wheel{native}{openblas}: llama.cpp's own CPU kernels, and the output matrix it applies "
        "at every position (BENCHMARKS.md section 7 says where the time goes)."
    )
