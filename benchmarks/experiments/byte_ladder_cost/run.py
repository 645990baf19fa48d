"""What a ladder of GGUF files costs, as a user runs it: `export --type T`, then `export --size` at two budgets,
each a command of its own (a fresh process), on a cache of its own (the packaged models and texts linked, nothing
measured before). Per command its seconds and whether its log read the importance weights and the rounding errors
"from cache" (issue "What a run costs": after `--type`, `--size` reads no calibration again; the second budget of
a ladder takes under a minute on the bundled model).

    python -m benchmarks.experiments.byte_ladder_cost.run --out benchmarks/results/choices/byte-ladder-cost.json

About 4 minutes on 2 cores for the bundled model.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite.common import cache_of_its_own, command_line, log, machine_info, write_json

#: The real cache's folders a fresh one links in: assets, not measurements.
SHARED = ("models", "text", "zero-shot")
#: The two stages a byte budget measures, as its log names them; a stage read instead says "from cache".
STAGES = {"importance": "Importance weights", "rounding_errors": "Rounding errors per type"}


def timed_export(model: str, out: Path, flags: list[str], cache: Path) -> dict:
    """One `masa-compress export` in a process of its own: its seconds and which stages it read from the cache."""
    command = [sys.executable, "-m", "compressor", "export", model, str(out), *flags, "--overwrite"]
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "MASA_CACHE": str(cache), "COLUMNS": "200"},
                          capture_output=True, text=True, check=True)  # fmt: skip
    seconds = time.perf_counter() - start
    text = " ".join((done.stdout + done.stderr).split())
    return {
        "flags": " ".join(flags), "seconds": round(seconds, 1),
        "stages": {stage: _how(text, name) for stage, name in STAGES.items()},
    }  # fmt: skip


def _how(log_text: str, name: str) -> str | None:
    """How the log says stage `name` ran: "from cache", "measured", or None (it did not run)."""
    if name not in log_text:
        return None
    return "from cache" if "from cache" in log_text.split(name, 1)[1][:120] else "measured"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--type", default="q4_k_m", dest="tensor_type")
    parser.add_argument("--sizes", default="100MiB,86MiB", help="the ladder's budgets after --type, in order")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    steps = [
        ["--type", args.tensor_type],
        *(["--size", s.strip()] for s in args.sizes.split(",") if s.strip()),
    ]
    with tempfile.TemporaryDirectory(prefix="masa-ladder-") as work:
        cache = cache_of_its_own(Path(work) / "cache", SHARED)
        runs = []
        for index, flags in enumerate(steps):
            log(f"export {args.model} {' '.join(flags)}")
            runs.append(timed_export(args.model, Path(work) / f"{index}.gguf", flags, cache))
            log(f"  {runs[-1]['seconds']} s, {runs[-1]['stages']}")
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.byte_ladder_cost.run", argv), "model": args.model,
        "machine": machine_info(), "runs": runs,
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
