"""The tool at the 1.5B model's shapes on a GPU: what `plan` predicts against what the run takes.

A random Qwen2 model with Qwen2.5-Coder-1.5B's configuration as its recipe carries it (28 layers, hidden 1536,
12 heads, 2 KV heads, MLP 8960, vocabulary 151,936, untied output), in bfloat16, with a byte-level tokenizer: no
weights to fetch (the GPU machine reaches no registry), the same shapes and therefore the same memory and arithmetic as the real model;
its perplexities mean nothing. The real model's quality is `benchmarks/engines/large.py`'s, on a CPU.

    python -m benchmarks.engines.gpu_scale [--tiny] [--out results.json] [-- COMPRESS OPTIONS]

Runs, through the CLI in-process: `--dry-run` (the plan of the run's own options; its `memory.in_memory_bytes` is the GPU's memory on a GPU), then the
model 20% smaller (`--targets attn,mlp --ratio 0.2 --ratio-of model`, 64 x 512 calibration tokens), then
`eval` of the checkpoint. Records each stage's seconds, the peak GPU memory PyTorch allocated and reserved, the
peak host RSS, and the reloaded checkpoint's perplexity beside the run's; on a GPU also the peak each step allocated
(`STEPS`), to say which step sets the run's peak. Needs CUDA (`--tiny` runs a small
model on the CPU to check the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

#: The recipe whose `shapes` (Qwen2.5-Coder-1.5B's published config values) the random model takes.
RECIPE = "qwen2.5-coder-1.5b"
#: `--tiny`: the same family and layout, small enough for the CPU.
TINY_SHAPES = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                   vocab_size=1024)  # fmt: skip


#: The steps whose own GPU peak is recorded: name -> the module attributes the pipeline calls them by.
STEPS = {
    "calibration (layer by layer)": ["compressor.api.layerwise:collect_statistics_layerwise"],
    "sensitivity (layer by layer)": ["compressor.api.layerwise:collect_sensitivity_layerwise"],
    "evaluation (layer by layer)": [
        "compressor.api.layerwise:spill_original_outputs", "compressor.api.layerwise:evaluate_layerwise",
    ],
    "neuron order": ["compressor.methods.masa.mlp:neuron_order"],
    "neuron tail": ["compressor.methods.masa.mlp:order_tail"],
    "neuron refit": ["compressor.methods.masa.mlp:refit_down"],
    "head tails": ["compressor.methods.masa.basis:attention_heads.head_tails"],
    "head install": ["compressor.methods.masa.basis:attention_heads.install_heads"],
    "residual spectra": ["compressor.methods.masa.method:residual_tail"],
    "residual factors": ["compressor.methods.masa.method:install_projection"],
}  # fmt: skip


class StepPeaks:
    """Each step's peak GPU allocation (`STEPS`, patched for the run) and the peak between steps: torch keeps one
    peak counter, so each step folds it into the run's peaks (allocated per step, reserved overall), resets it,
    and reads its own at its end."""

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.reserved = 0.0
        self._running: list[str] = []  # the steps under way, innermost last (a step may call another)
        self._patched: list[tuple[object, str, object]] = []

    def _fold(self, name: str) -> None:
        peak = torch.cuda.max_memory_allocated() / 2**30
        self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved() / 2**30)
        torch.cuda.reset_peak_memory_stats()

    def _wrap(self, name: str, function):
        @functools.wraps(function)
        def step(*args, **kwargs):
            self._fold(self._running[-1] if self._running else "between steps")
            self._running.append(name)
            try:
                return function(*args, **kwargs)
            finally:
                self._fold(self._running.pop())

        return step

    def __enter__(self) -> StepPeaks:
        for name, places in STEPS.items():
            for place in places:
                module_name, path = place.split(":")
                owner = importlib.import_module(module_name)
                *parents, attribute = path.split(".")
                for parent in parents:
                    owner = getattr(owner, parent)
                original = getattr(owner, attribute)
                self._patched.append((owner, attribute, original))
                setattr(owner, attribute, self._wrap(name, original))
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *_) -> None:
        self._fold("between steps")
        for owner, attribute, original in reversed(self._patched):
            setattr(owner, attribute, original)

    @property
    def peak(self) -> float:
        return max(self.peaks.values(), default=0.0)


def model_shapes(tiny: bool = False) -> dict:
    """The random model's config values: the recipe's `shapes` (so this benchmark and `plan` of the recipe read
    the same numbers), or, with `tiny`, those with `TINY_SHAPES` over them. Values no shape depends on (the
    rotary base, the norms' epsilon) keep transformers' defaults: random weights make them irrelevant here."""
    from compressor.recipes.schema import builtin_recipe

    shapes = builtin_recipe(RECIPE).shapes.model_dump()
    return {**shapes, **(TINY_SHAPES if tiny else {})}


def _random_model_dir(path: Path, shapes: dict, device: torch.device) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from conftest import byte_tokenizer  # the tests' tokenizer: any text, no downloads

    torch.manual_seed(0)
    with torch.device(device):
        config = AutoConfig.for_model(**shapes)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    del model
    return path


def _text(path: Path, files: list[Path], chars: int) -> Path:
    """Real text for the byte tokenizer: the repository's own files, repeated to `chars` characters."""
    text = "\n\n".join(p.read_text() for p in sorted(files))
    path.write_text((text * (chars // len(text) + 1))[:chars])
    return path


def _plain_forward_seconds(
    model_dir: str, device: torch.device, windows: int = 64, seq_len: int = 512
) -> float:
    """One plain forward pass over as many tokens as the calibration reads (the reference of the run's cost)."""
    from transformers import AutoModelForCausalLM

    from compressor.runtime.device import weight_loading

    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, **weight_loading(torch.bfloat16)).to(device).eval()
    )
    tokens = torch.randint(0, 256, (windows, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model(tokens[:1])  # warm-up: kernels chosen, memory pooled
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for window in tokens:
            model(window[None])
        if device.type == "cuda":
            torch.cuda.synchronize()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - start


def _cli_json(args: list[str]) -> dict:
    from compressor.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*args, "--json"])
    return json.loads(out.getvalue())


def run(tiny: bool, options: tuple[str, ...] = ()) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    with tempfile.TemporaryDirectory(prefix="gpu-scale-") as work:
        return _run_in(Path(work), device, options) | {"options": list(options)}


def _run_in(work: Path, device: torch.device, options: tuple[str, ...]) -> dict:
    gpu, tiny = device.type == "cuda", device.type == "cpu"
    start = time.perf_counter()
    shapes = model_shapes(tiny)
    model = str(_random_model_dir(work / "model", shapes, device))
    root = Path(__file__).resolve().parents[2]
    # calibration: the docs (64 x 512 bytes, with room to sample); evaluation: the package's source
    text = str(_text(work / "calibration.txt", [root / "README.md", *root.glob("docs/*.md")], 600_000))
    eval_text = str(_text(work / "evaluation.txt", list(root.glob("compressor/**/*.py")), 200_000))
    made = time.perf_counter() - start
    forward = _plain_forward_seconds(model, device)
    request = ["--targets", "attn,mlp", "--ratio", "0.2", "--ratio-of", "model", "--calib", text]
    request += ["--calib-samples", "64", "--seq-len", "512", *options]
    # `--dry-run` is `plan` with the run's own calibration options (`plan` takes the recipe's).
    planned = _cli_json([model, *request, "--device", device.type, "--dry-run"])
    out = work / "compressed"
    with StepPeaks() if gpu else contextlib.nullcontext() as steps:
        run_json = _cli_json(
            [model, *request, "--eval-text", eval_text, "--eval-max-tokens", "32768", "--device", device.type]
            + ["--out", str(out), "--no-stats-cache"]
        )
    peak = (
        {
            "peak_gpu_allocated_gib": steps.peak,
            "peak_gpu_reserved_gib": steps.reserved,
            "peak_gpu_allocated_gib_by_step": steps.peaks,
        }
        if gpu
        else {}
    )
    scored = _cli_json(
        ["eval", str(out), "--text", eval_text, "--max-tokens", "32768", "--device", device.type]
    )
    memory = planned["memory"]
    return {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "config": shapes,
        "random_model_seconds": made,
        "plain_forward_seconds": forward,
        # a --layerwise run's plan is its layer-by-layer peak (one decoder layer on the device at a time)
        "planned_gib": memory["layerwise_bytes" if memory["layerwise"] else "in_memory_bytes"] / 2**30,
        "layerwise": memory["layerwise"],
        "planned_device": memory["device"],
        **peak,
        "peak_rss_gib": run_json["peak_rss_gb"],
        "seconds": run_json["seconds"],
        "achieved_ratio": run_json["achieved_ratio"],
        "ppl_after": run_json["ppl_after"],
        "reloaded_ppl": scored["ppl"],
        "reloaded_seconds": scored["seconds"],
        "checkpoint_bytes": run_json["checkpoint_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU: checks the script")
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    parser.add_argument(
        "options", nargs="*", help="more compress options, after --, e.g. -- --neuron-order energy"
    )
    args = parser.parse_args()
    results = run(args.tiny, tuple(args.options))
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
