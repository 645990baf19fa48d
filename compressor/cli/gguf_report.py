"""What the GGUF commands print: `export`'s summary of the file it wrote, `show FILE.gguf` (each matrix's type per
layer) and `show FILE.gguf --tensor-types` (those types as llama-quantize's overrides)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from compressor.runtime.errors import UserError

console = Console()


def print_export_summary(path, info: dict) -> None:
    """What `export` wrote as a GGUF, in a few lines."""
    console.print(
        f"Wrote {path}: llama.cpp architecture {info['architecture']}, {info['type']}, "
        f"{info['parameters']:,} parameters, {info['bytes'] / 2**20:.1f} MiB."
    )
    if info.get("budget") is not None:
        console.print(
            f"Within {info['budget']:,} bytes: {info['bytes']:,} written "
            f"({8 * info['bytes'] / info['parameters']:.2f} bits per weight); predicted rise of the "
            f"calibration loss {info['predicted_loss_rise']:.4f} nats per token."
        )
    if info.get("speed"):
        console.print(speed_line(info["speed"]))
    counts = info.get("type_counts") or {}
    if len(counts) > 1 or info.get("imatrix", "none") != "none":
        mix = ", ".join(f"{n} {t}" for t, n in counts.items())
        console.print(f"Matrices: {mix}; importance weights: {info.get('imatrix', 'none')}.")
    compensated = info.get("rounding", {})
    if compensated.get("rounding") == "compensated":
        damped = f", {len(compensated['damped'])} needing more damping" if compensated["damped"] else ""
        console.print(
            f"Rounding compensated: {compensated['matrices']} matrices, on {compensated['windows']} calibration "
            f"windows ({compensated['seconds']:.0f} s{damped}); the embedding, output and value matrices rounded nearest."
        )
    if info.get("imatrix_file"):
        written = info["imatrix_file"]
        console.print(
            f"Wrote {written['path']}: llama.cpp's importance matrix, {written['entries']} matrices, "
            f"{written['chunks']} windows of {written['chunk_size']} tokens (llama-quantize --imatrix reads it)."
        )
    if info.get("engine_note"):
        console.print(f"Note: {info['engine_note']}.")
    if info.get("tensor_types_file"):
        recipe = info["tensor_types_file"]
        exact = (
            ""
            if compensated.get("rounding") != "compensated"
            else " (its rounding is nearest: same types, other blocks)"
        )
        console.print(
            f"Wrote {recipe['path']}: {recipe['tensors']} --tensor-type overrides; apply them{exact} with"
        )
        console.print(recipe["command"], markup=False, highlight=False, soft_wrap=True)
        if "IMATRIX.gguf" in recipe["command"]:
            console.print(
                "(IMATRIX.gguf: the importance weights this file was rounded with: add --imatrix-out FILE)"
            )
        if recipe.get("input_command"):
            console.print(f"(MODEL-F32.gguf, the original in f32: {recipe['input_command']})", markup=False)
    if info["fallbacks"]:
        kinds = sorted(set(info["fallbacks"].values()))
        console.print(
            f"{len(info['fallbacks'])} matrices are stored as {', '.join(kinds)}: their rows do not fill whole "
            f"{info['type']} blocks (first: {next(iter(info['fallbacks']))}); --json lists them."
        )


def print_tensor_types(path: str) -> None:
    from compressor.quantize.tensor_types import recipe_lines, tensor_type_overrides

    if not path.endswith(".gguf") or not Path(path).is_file():
        raise UserError(f"--tensor-types {path}: not a GGUF file: pass FILE.gguf")
    for line in recipe_lines(tensor_type_overrides(path)):
        print(line)


def show_gguf(path: str, as_json: bool) -> None:
    from compressor.quantize.gguf_types import describe_gguf

    info = describe_gguf(path)
    if as_json:
        print(json.dumps(info))
        return
    mix = ", ".join(f"{n} {t}" for t, n in info["type_counts"].items())
    console.print(
        f"{info['path']}: llama.cpp architecture {info['architecture']}, {info['file_type']}, "
        f"{info['parameters']:,} parameters, {info['bytes'] / 2**20:.1f} MiB; importance weights: {info['imatrix']}"
    )
    console.print(f"Matrices: {mix}; " + ", ".join(f"{k} {v}" for k, v in info["other_matrices"].items()))
    if info.get("only_types"):
        console.print(f"Types chosen among (--only-types): {info['only_types']}")
    if info.get("speed"):
        console.print(f"Decode speed held to (--speed): {info['speed']}")
    if info.get("rounding", "nearest") != "nearest":
        console.print(f"Rounding: {info['rounding']} (the decoder layers' matrices; see docs/options.md)")
    structure = info.get("structure")
    if structure:
        console.print(
            f"Structure chosen with the types (compress --size): {structure.get('note')}; "
            f"{structure.get('removed_parameters', 0):,} parameters removed; predicted loss rise "
            f"{structure.get('predicted_loss_rise', 0):.4f} nats (structure {structure.get('structure_loss_rise', 0):.4f})"
        )
    roles = sorted(
        {role for row in info["layers"] for role in row if role not in ("layer", "mlp_width", "q_rows")}
    )
    shapes = [k for k in ("mlp_width", "q_rows") if any(k in row for row in info["layers"])]
    roles = shapes + roles
    table = Table(title="GGML type per layer (and each layer's MLP width, q_proj rows)")
    for column in ("layer", *roles):
        header = {"mlp_width": "width", "q_rows": "q rows"}.get(column, column)
        table.add_column(header, justify="right" if column in ("layer", *shapes) else "left")
    for row in info["layers"]:
        table.add_row(str(row["layer"]), *(str(row.get(role, "")) for role in roles))
    console.print(table)


def speed_line(speed: dict) -> str:
    """What `--speed` decided, as predicted on this CPU (`quantize/speed.SpeedPlan.to_dict`)."""
    limit = f"{speed['limit_tokens_per_second']:.1f} tokens/s"
    limit = f"llama.cpp's {speed['mix']} mix of these bytes, {limit}" if speed["mix"] else limit
    held = (
        "the allocation was already within it"
        if speed["penalty"] == 0
        else f"{speed['unlimited_tokens_per_second']:.1f} tokens/s without the limit"
    )
    return (
        f"Decode predicted on this CPU ({speed['threads']} thread): {speed['predicted_tokens_per_second']:.1f} "
        f"tokens/s, held to {limit}; {held}. The matrices' time alone: llama.cpp measures fewer tokens/s for "
        "every file alike."
    )
