"""`plan`'s time against the run's: per stage, the estimate (`compressor/api/time_estimate.py`) beside what a run
measured, alone on this machine, its statistics measured afresh (a cache of its own: the packaged models and texts
linked in, nothing else).

Each run is `masa-compress MODEL ARGS --json` in a fresh process; its summary holds the stage times it took
(`seconds`) and what `plan` priced them at (`seconds_planned`). `--fit` also prints each stage's factor that makes
the estimate equal to this run (measured / the estimate's arithmetic): how `STAGE_FACTORS` were set, on the bundled
model; the 1.5B model's run checks them. `--merge` adds the run to the results file.

    python -m benchmarks.experiments.plan_time.run --model smollm2-135m --fit \\
        --args "--targets attn,mlp --ratio 0.2 --ratio-of model --native --no-save" \\
        --out benchmarks/results/choices/plan-time.json
    python -m benchmarks.experiments.plan_time.run --orders --out benchmarks/results/choices/plan-time.json

A `--size` run is compared the same way (`plan --size`: `compressor/api/size_time.py`); its `--fit` gives the
factors of the stages a byte budget adds (`SIZE_FACTORS`): see README.md for the two runs.

`--orders` times one MLP of the 1.5B model's widths (the block greedy's order and its errors) beside their
arithmetic: the factors `ORDER_FACTORS` takes for them (the bundled model's run orders its neurons greedily).

`--decode-cost SIZE` times what `--speed mix` measures the first time on this CPU (llama.cpp's decode cost of
every type the chooser asks for at that budget, on a cache of its own) beside what `plan --size SIZE --speed mix`
prices it at (`size_time.decode_cost_seconds`):

    python -m benchmarks.experiments.plan_time.run --decode-cost 80MiB --out benchmarks/results/choices/plan-time.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.suite.common import cache_of_its_own, command_line, log, machine_info, write_json


def measured_run(model: str, args: list[str]) -> dict:
    """The run's `--json` summary, in a fresh process on a cache of its own."""
    with tempfile.TemporaryDirectory(prefix="masa-plan-time-") as work:
        cache = str(cache_of_its_own(Path(work) / "cache", ("models", "text", "rates")))
        if "--size" in args:  # its GGUF, written beside the cache and removed with it
            args = [*args, "--out", str(Path(work) / "out.gguf")]
        done = subprocess.run([sys.executable, "-m", "compressor", model, *args, "--json"], capture_output=True,
                              text=True, env=os.environ | {"MASA_CACHE": cache})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(summary: dict) -> dict:
    """Per stage the measured and the planned seconds and their ratio (measured / planned); the run's whole time
    (what the user waits: every stage, priced or not) against `plan`'s total."""
    measured, planned = dict(summary["seconds"]), summary["seconds_planned"]
    measured.pop("structure_total", None)  # a --size run's structure stages, summed (each is compared)
    # `plan`'s evaluation is both models' passes; a run that scores the original first times it apart.
    measured["eval"] = measured.get("eval", 0.0) + measured.pop("eval_before", 0.0)
    stages = {stage: {"measured": round(measured.get(stage, 0.0), 1), "planned": planned[stage],
                      "ratio": round(measured.get(stage, 0.0) / planned[stage], 3) if planned[stage] else None}
              for stage in planned if stage != "total"}  # fmt: skip
    priced = sum(measured.get(stage, 0.0) for stage in stages)
    unpriced = {k: round(v, 1) for k, v in measured.items() if k not in stages and k != "total"}
    return {"stages": stages, "unpriced": unpriced, "priced_total": round(priced, 1),
            "measured_total": round(measured["total"], 1), "planned_total": planned["total"],
            "total_ratio": round(measured["total"] / planned["total"], 3)}  # fmt: skip


def time_orders(width: int = 8960, hidden: int = 1536, tokens: int = 12000) -> dict:
    """One MLP of these widths (the 1.5B model's) timed alone: the block greedy's order and `order_tail`'s errors
    (a random autocorrelation of `tokens` tokens), beside their arithmetic at this machine's rates: the factors
    `ORDER_FACTORS` takes for "greedy-block" and "tail"."""
    import time

    import torch

    from compressor.api.time_estimate import machine_rates
    from compressor.math.neurons import neuron_order, order_tail

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=generator)
    c, down = (x.T @ x).double() / tokens, torch.randn(hidden, width, generator=generator)
    start = time.perf_counter()
    order = neuron_order("greedy-block", c, down, 1e-4)
    middle = time.perf_counter()
    order_tail(c, down, order, 1e-4)
    end = time.perf_counter()
    rates = machine_rates(torch.device("cpu"))
    block = (width**3 / 3 + width * width * hidden / 2) / rates.gemm
    tail = width**3 / 3 / rates.factor
    return {"width": width, "hidden": hidden, "order_s": round(middle - start, 2), "tail_s": round(end - middle, 2),
            "greedy-block": round((middle - start) / block, 2), "tail": round((end - middle) / tail, 2)}  # fmt: skip


def time_decode_costs(model: str, size: str) -> dict:
    """`plan --size SIZE --speed mix`'s price of the decode-cost measurement, and the measurement's own time, on a
    cache of its own (no type measured; the probe `plan` times counted in the plan's seconds)."""
    import time

    from compressor.api.model_loading import resolve_model
    from compressor.api.preview import model_parameter_count, read_model_config
    from compressor.api.size_time import decode_cost_seconds, speed_types
    from compressor.quantize.byte_budget import parse_budget
    from compressor.quantize.decode_cost import decode_costs, unmeasured_types
    from compressor.quantize.rounding_rates import rounding_rates
    from compressor.quantize.speed import SPEED_THREADS

    config = read_model_config(resolve_model(model))[0]
    budget = parse_budget(size, None).bytes_for(model_parameter_count(config))
    layer, types = speed_types(config, budget, mix=True)
    before = os.environ.get("MASA_CACHE")
    with tempfile.TemporaryDirectory(prefix="masa-plan-time-") as work:
        os.environ["MASA_CACHE"] = str(cache_of_its_own(Path(work) / "cache", ("models", "text", "rates")))
        try:
            start = time.perf_counter()
            planned = decode_cost_seconds(config, budget, "mix", rounding_rates())
            plan_seconds = time.perf_counter() - start
            missing = unmeasured_types(types, layer, SPEED_THREADS)
            start = time.perf_counter()
            decode_costs(sorted(types), layer, SPEED_THREADS, progress=False)
            measured = time.perf_counter() - start
        finally:
            os.environ.pop("MASA_CACHE") if before is None else os.environ.update(MASA_CACHE=before)
    return {"model": model, "size": size, "types": missing, "measured_s": round(measured, 1),
            "planned_s": round(planned, 1), "plan_s": round(plan_seconds, 1),
            "ratio": round(measured / planned, 3)}  # fmt: skip


def stage_factors(size: bool) -> dict[str, float]:
    """Each stage's factor this run was planned with: a `compress` run's `STAGE_FACTORS`; a `--size` run's
    `SIZE_FACTORS` for the stages a byte budget adds, its structure's `structure_*` at the compress run's."""
    from compressor.api.size_time import SIZE_FACTORS
    from compressor.api.time_estimate import STAGE_FACTORS

    if not size:
        return dict(STAGE_FACTORS)
    return {f"structure_{stage}": factor for stage, factor in STAGE_FACTORS.items()} | SIZE_FACTORS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--args", default="--targets attn,mlp --ratio 0.2 --ratio-of model --native --no-save"
    )
    parser.add_argument("--fit", action="store_true", help="print the factors that fit this run")
    parser.add_argument("--merge", action="store_true", help="add the run to --out's runs")
    parser.add_argument("--orders", action="store_true", help="time one 1.5B-wide MLP's neuron order only")
    parser.add_argument(
        "--decode-cost", metavar="SIZE", help="time --speed mix's first decode-cost measurement"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.orders or args.decode_cost:
        data = (
            json.loads(args.out.read_text())
            if args.out.is_file()
            else {"machine": machine_info(), "runs": []}
        )
        key = "neuron_orders" if args.orders else "decode_cost"
        data[key] = time_orders() if args.orders else time_decode_costs(args.model, args.decode_cost)
        write_json(args.out, data)
        log(f"{key}: {data[key]}")
        return
    log(f"masa-compress {args.model} {args.args} --json (a fresh cache)")
    summary = measured_run(args.model, shlex.split(args.args))
    factors = stage_factors("budget" in summary)
    row = {"model": args.model, "args": args.args, "command": command_line("benchmarks.experiments.plan_time.run",
           argv), **compare(summary), "stage_factors": factors}  # fmt: skip
    if args.fit:
        row["fitted_factors"] = {
            stage: round(factors[stage] * values["ratio"], 4)
            for stage, values in row["stages"].items() if values["ratio"] is not None
        }  # fmt: skip
        log(f"fitted factors: {row['fitted_factors']}")
    runs = json.loads(args.out.read_text())["runs"] if args.merge and args.out.is_file() else []
    write_json(args.out, {"machine": machine_info(), "runs": [*runs, row]})
    log(f"{args.model}: measured {row['measured_total']:.0f} s, planned {row['planned_total']:.0f} s "
        f"({row['total_ratio']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
