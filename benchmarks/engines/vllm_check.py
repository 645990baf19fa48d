"""The smaller model served by vLLM: its CPU wheel (in a virtual environment of its own, `.venv-vllm`: the install
is several GB and pins its own transformers) runs what `export --format hf` writes, and its greedy output is
checked token for token against transformers'.

Two forms of the model 20% smaller (`--targets attn,mlp --ratio 0.2 --ratio-of model --native`):
- `per-layer`: MLP widths per layer, written with `--layout deci` (vLLM's `DeciLMForCausalLM`, the configuration
  class shipped beside the weights): transformers' reference is the checkpoint itself;
- `uniform`: `--uniform-mlp`, written with the default layout (a plain `LlamaForCausalLM` with a narrower MLP):
  transformers' reference is the exported folder, loaded without remote code.
Query heads that `--native` removed are zero heads in both (vLLM's DeciLM varies KV heads per layer, not query
heads): exact, stated.

Three steps, two interpreters (`make bench-vllm` runs them):
    .venv/bin/python -m benchmarks.engines.vllm_check reference WORK    # compress, export, transformers' greedy tokens
    .venv-vllm/bin/python -m benchmarks.engines.vllm_check serve WORK   # vLLM's greedy tokens (fp32, eager)
    .venv/bin/python -m benchmarks.engines.vllm_check report WORK       # benchmarks/results/vllm.{json,md}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m"
RATIO = 0.2
NEW_TOKENS = 32
PROMPTS = (
    "The capital of France is",
    "In 1905, Albert Einstein published",
    "A recipe for bread needs flour, water,",
    "The largest planet in the solar system",
)
FORMS = {
    "per-layer": {"layout": "deci", "uniform_mlp": False},
    "uniform": {"layout": "padded", "uniform_mlp": True},
}
RESULTS = Path(__file__).resolve().parents[1] / "results"


def reference(work: Path) -> None:
    """Compress, export for vLLM, and record transformers' greedy continuations (main environment)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor.api import CompressOptions, compress
    from compressor.api.export import export
    from compressor.checkpoint import load_compressed

    work.mkdir(parents=True, exist_ok=True)
    record: dict = {"model": MODEL, "ratio_of_model": RATIO, "new_tokens": NEW_TOKENS, "forms": {}}
    for form, how in FORMS.items():
        checkpoint, folder = work / f"{form}-ckpt", work / f"{form}-hf"
        options = CompressOptions(
            ratio=RATIO, ratio_of="model", targets="attn,mlp", native=True, uniform_mlp=how["uniform_mlp"],
            evaluate=False, out=str(checkpoint), overwrite=True,
        )  # fmt: skip
        compress(MODEL, options, device="cpu", dtype="float32", progress=False)
        written = export(
            str(checkpoint), folder, format="hf", layout=how["layout"], overwrite=True, progress=False
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # our configuration class
        if how["layout"] == "deci":  # transformers has no DeciLM model: the checkpoint is the reference
            model = load_compressed(checkpoint)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        rows = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(
                    ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
                )
            rows.append(
                {
                    "prompt": prompt,
                    "prompt_ids": ids[0].tolist(),
                    "transformers": out[0, ids.shape[1] :].tolist(),
                }
            )
        record["forms"][form] = {
            "folder": str(folder),
            "architecture": json.loads((folder / "config.json").read_text())["architectures"][0],
            "parameters_in_folder": written.details["dense_params"],
            "parameters_in_checkpoint": written.details["compressed_params"],
            "mlp_widths": [layer.mlp.down_proj.in_features for layer in model.model.layers],
            "rows": rows,
        }
    (work / "reference.json").write_text(json.dumps(record, indent=2))


def serve(work: Path) -> None:
    """vLLM's greedy continuations of the same prompt ids (vLLM's environment)."""
    import vllm
    from vllm import LLM, SamplingParams

    record = json.loads((work / "reference.json").read_text())
    record["vllm_version"] = vllm.__version__
    for form in record["forms"].values():
        start = time.perf_counter()
        engine = LLM(
            model=form["folder"],
            dtype="float32",
            enforce_eager=True,
            trust_remote_code=True,
            max_model_len=256,
            seed=0,
            gpu_memory_utilization=0.15,
        )  # fmt: skip (on CPU: of RAM)
        form["vllm_start_seconds"] = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        prompts = [{"prompt_token_ids": row["prompt_ids"]} for row in form["rows"]]
        for row, output in zip(form["rows"], engine.generate(prompts, params), strict=True):
            row["vllm"] = list(output.outputs[0].token_ids)
        del engine
    (work / "served.json").write_text(json.dumps(record, indent=2))


def report(work: Path) -> dict:
    """Token-for-token agreement per form; benchmarks/results/vllm.{json,md}."""
    record = json.loads((work / "served.json").read_text())
    for form in record["forms"].values():
        for row in form["rows"]:
            same = [a == b for a, b in zip(row["transformers"], row["vllm"], strict=False)]
            row["identical"] = row["transformers"] == row["vllm"]
            row["first_difference"] = None if row["identical"] else (same + [False]).index(False)
        form["identical"] = all(row["identical"] for row in form["rows"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm.json").write_text(json.dumps(record, indent=2) + "\n")
    (RESULTS / "vllm.md").write_text(render(record))
    return record


def render(record: dict) -> str:
    lines = [
        "# The smaller model in vLLM",
        "",
        f"`{record['model']}` {record['ratio_of_model']:.0%} smaller (`--targets attn,mlp --ratio-of model --native`), "
        f"exported with `masa-compress export --format hf` and served by vLLM {record['vllm_version']} (CPU wheel, "
        f"fp32, eager); greedy, {record['new_tokens']} new tokens after each of {len(PROMPTS)} prompts, compared "
        "token for token with transformers. `python -m benchmarks.engines.vllm_check` (`make bench-vllm`).",
        "",
        "| form | vLLM architecture | parameters (folder / checkpoint) | MLP widths | identical prompts | vLLM start (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, form in record["forms"].items():
        widths = form["mlp_widths"]
        span = f"{min(widths)}–{max(widths)}" if min(widths) != max(widths) else f"{widths[0]} (all)"
        same = sum(row["identical"] for row in form["rows"])
        lines.append(
            f"| {name} | {form['architecture']} | {form['parameters_in_folder']:,} / "
            f"{form['parameters_in_checkpoint']:,} | {span} | {same}/{len(form['rows'])} | "
            f"{form['vllm_start_seconds']:.0f} |"
        )
    lines += [
        "",
        "The folder holds the query heads `--native` removed as zero heads (vLLM's DeciLM layout varies a layer's "
        "KV heads, not its query heads): the same outputs, more parameters than the checkpoint.",
    ]
    for name, form in record["forms"].items():
        for row in form["rows"]:
            if not row["identical"]:
                lines.append(
                    f"- {name}, “{row['prompt']}”: first different token at position {row['first_difference']}."
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("reference", "serve", "report"))
    parser.add_argument("work", type=Path)
    args = parser.parse_args(argv)
    {"reference": reference, "serve": serve, "report": report}[args.step](args.work)
    return 0


if __name__ == "__main__":  # vLLM starts a process of its own: the guard is required
    sys.exit(main())
