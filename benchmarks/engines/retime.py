"""`make bench-engines`'s speed phase again, for a run whose timings a busy machine disturbed: on the run's own GGUF
files where they were kept (`--files DIR`), else on the same files rebuilt; each file's bytes checked against the
recorded run, then engines.json, engines.md and the summary figures written again.

    python -m benchmarks.engines.retime [--files DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.engines.llama_cpp import (
    EXPORTS,
    MODEL,
    _prompt_ids,
    compress_engine_form,
    export_files,
    gguf_name,
    measure_speeds,
    speed_ratios,
    write_outputs,
)
from benchmarks.suite.common import command_line


def retime(results: dict, work: Path, kept: Path | None = None) -> dict:
    """The speed phase again, for a run whose timings a busy machine disturbed: on the run's own files where they
    were kept (`kept`: a folder holding them under their names in the run), else on the same files rebuilt
    (compression is deterministic); either way each file's bytes are checked against the recorded run."""
    files = _kept_files(kept) if kept is not None else _rebuilt_files(results, work)
    rows = {(r["model"], r["type"]): r for r in results["llama_cpp"]}
    for key, written in files.items():
        if written["bytes"] != rows[key]["bytes"]:
            raise SystemExit(
                f"{key}: the file to time has {written['bytes']} bytes, the recorded run's {rows[key]['bytes']}"
            )
    prompt = _prompt_ids()
    for key, speed in measure_speeds({k: Path(w["out"]) for k, w in files.items()}, prompt).items():
        rows[key].update(speed)
    results["speed_retimed"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["speed_retimed_files"] = "kept from the run" if kept is not None else "rebuilt"
    return speed_ratios(results)


def _kept_files(folder: Path) -> dict:
    """The timed files of a run (every export but f32), by their names in the run, from a folder they were copied
    to."""
    files = {}
    for kind, tensor_type in EXPORTS:
        path = folder / gguf_name(kind, tensor_type)
        if tensor_type == "f32":
            continue
        if not path.is_file():
            raise SystemExit(f"--files: {path} is missing: copy every .gguf of the run's folder there")
        files[(kind, tensor_type)] = {"out": str(path), "bytes": path.stat().st_size}
    return files


def _rebuilt_files(results: dict, work: Path) -> dict:
    ratio, chosen = results["ratio_of_model"], results["choice"]["chosen"]
    sources = {"original": MODEL}
    # the folder names of `run`: the files record their source's path, so the bytes compare
    for kind, folder, forms in (("native", "native", {"native": True}),
                                ("native uniform", "uniform", {"native": True, "uniform_mlp": True}),
                                ("mlp only", f"mlp-w{chosen}", {"width_multiple": chosen})):  # fmt: skip
        targets = "mlp" if kind == "mlp only" else "attn,mlp"
        compress_engine_form(ratio, work / folder, targets=targets, **forms)
        sources[kind] = str(work / folder)
    return export_files(sources, work, only_timed=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/engines.json", help="the recorded run")
    parser.add_argument("--doc", default="benchmarks/results/engines.md")
    parser.add_argument("--files", type=Path, help="a folder holding the run's own GGUF files (else rebuilt)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="masa-engines-") as work:
        results = retime(json.loads(Path(args.out).read_text()), Path(work), args.files)
    results["retime_command"] = command_line("benchmarks.engines.retime", argv)
    write_outputs(results, args.out, args.doc)


if __name__ == "__main__":
    main()
