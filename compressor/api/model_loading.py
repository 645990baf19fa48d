"""Model resolution and loading: one function used by every command.

A model spec is one of
- a recipe alias (`smollm2-135m`, `llama-3.2-1b`, ... see `recipes/`), naming a hub id or the bundled file;
- a local Hugging Face directory, or a local `.gguf` file;
- a hub id `owner/name` (needs the network);
- a compressed checkpoint written by `masa-compress` (a directory holding `masa_config.json`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from compressor.api.packaged_models import PACKAGED_MODELS, ensure_gguf, gguf_directory, packaged_model
from compressor.modeling.families import SUPPORTED_MODEL_TYPES
from compressor.recipes.schema import Recipe, builtin_recipe, builtin_recipe_names
from compressor.runtime.cache_root import cache_dir
from compressor.runtime.device import resolve_device, resolve_dtype, weight_loading
from compressor.runtime.errors import UserError
from compressor.runtime.hub import check_hub_model
from compressor.runtime.progress import note

BUNDLED_GGUF = PACKAGED_MODELS["smollm2-135m"].gguf_file
COMPRESSED_CONFIG = "masa_config.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

ModelKind = Literal["bundled", "hf_dir", "gguf", "hub", "compressed"]


@dataclass
class ModelSource:
    """Where a model comes from, resolved from what the user typed."""

    spec: str
    kind: ModelKind
    location: str
    recipe: Recipe | None = None
    revision: str | None = None
    gguf_file: str | None = None
    local_only: bool = False  # a hub model read from the local cache (the hub cannot be reached: `hub.py`)
    packaged: str | None = None  # kind "bundled": the name of the packaged model (`packaged_models.py`)
    # `read_config`'s last read (where, how, the config): a GGUF's metadata takes seconds to parse, and a run reads
    # the config for its settings (`model_shapes`) before `plan` or the memory check read it again.
    _config: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def describe(self) -> str:
        """Short human-readable name: the alias (or spec) and what it points to."""
        target = {
            "bundled": f"bundled {PACKAGED_MODELS[self.packaged].title}" if self.packaged else "bundled",
            "gguf": f"GGUF {self.gguf_file}",
            "hub": f"hub {self.location}" + (f"@{self.revision}" if self.revision else ""),
            "hf_dir": f"dir {self.location}",
            "compressed": f"masa checkpoint {self.location}",
        }[self.kind]
        return (
            target
            if self.spec in (self.location, f"bundled:{self.recipe.name if self.recipe else ''}")
            else f"{self.spec} ({target})"
        )


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    seconds: float
    offloaded: object | None = None  # `--layerwise`: the `modeling.offload.OffloadedModel` (layers on disk)


def resolve_model(spec: str, recipe: Recipe | None = None) -> ModelSource:
    """Resolve a model spec without loading any weights (cheap: checked before heavy work)."""
    spec = (spec or "").strip()
    if not spec:
        raise UserError("no model given: pass a recipe alias (e.g. smollm2-135m), a local path or a hub id")
    if spec.startswith("bundled:"):
        return _resolve_bundled(spec, recipe)
    alias = builtin_recipe(spec) if "/" not in spec and not spec.endswith(".gguf") else None
    if alias is not None:
        inner = _resolve_target(alias.model, alias.revision)
        inner.spec, inner.recipe = spec, alias
        return inner
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_path(spec, path, recipe)
    if _looks_like_path(spec):
        raise UserError(
            f"model path '{spec}' does not exist: check the path, or pass a recipe alias or hub id"
        )
    if _HUB_ID.match(spec):
        return ModelSource(spec=spec, kind="hub", location=spec, recipe=recipe)
    raise UserError(
        f"unknown model '{spec}': not a recipe alias ({', '.join(builtin_recipe_names())}), "
        "an existing path, or a hub id of the form owner/name"
    )


def _resolve_target(target: str, revision: str | None) -> ModelSource:
    if target.startswith("bundled:"):
        return _resolve_bundled(target, None)
    path = Path(target).expanduser()
    if path.exists():
        return _resolve_path(target, path, None)
    return ModelSource(spec=target, kind="hub", location=target, revision=revision)


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith((".", "/", "~"))
        or spec.endswith((".gguf", ".safetensors", ".json"))
        or spec.count("/") > 1
        or os.sep != "/"
        and os.sep in spec
    )


def _resolve_path(spec: str, path: Path, recipe: Recipe | None) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(
                f"model file '{spec}' is not a GGUF file: pass a .gguf file or a Hugging Face model directory"
            )
        return ModelSource(
            spec=spec, kind="gguf", location=str(path.parent.resolve()), recipe=recipe, gguf_file=path.name
        )
    if (path / COMPRESSED_CONFIG).is_file():
        return ModelSource(spec=spec, kind="compressed", location=str(path.resolve()), recipe=recipe)
    if not (path / "config.json").is_file():
        raise UserError(
            f"directory '{spec}' is not a model: it has no config.json (a Hugging Face model directory) "
            f"nor {COMPRESSED_CONFIG} (a masa-compress checkpoint)"
        )
    return ModelSource(spec=spec, kind="hf_dir", location=str(path.resolve()), recipe=recipe)


def _resolve_bundled(spec: str, recipe: Recipe | None) -> ModelSource:
    """A packaged model (`packaged_models.py`): the bundled one, or one assembled from registry parts on first
    use (not here: resolving stays cheap)."""
    model = packaged_model(spec.removeprefix("bundled:"))
    return ModelSource(
        spec=spec,
        kind="bundled",
        location=str(gguf_directory(model)),
        recipe=recipe,
        gguf_file=model.gguf_file,
        packaged=model.name,
    )


# ------------------------------------------------------------------------------------------------------
# Loading


def check_architecture(config, where: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = ",".join(getattr(config, "architectures", None) or [str(model_type)])
        raise UserError(
            f"unsupported architecture '{archs}' (model_type '{model_type}') in {where}: supported are the "
            f"families of the README's support matrix ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def bundled_cache_dir(name: str) -> Path:
    """Where a packaged model's converted safetensors copy lives."""
    return cache_dir() / "models" / PACKAGED_MODELS[name].title.lower()


def needs_conversion(source: ModelSource) -> bool:
    """Whether loading `source` first converts a packaged model's GGUF (`bundled_model_dir`: once per cache)."""
    if source.kind != "bundled":
        return False
    return not (bundled_cache_dir(packaged_model(source.packaged).name) / ".complete").is_file()


def bundled_model_dir(source: ModelSource, progress: bool = True) -> Path:
    """Convert a packaged model's GGUF once into a plain safetensors directory (later loads take < 1 s), after
    assembling the GGUF from its registry parts where it has not been yet.

    `save_pretrained` refuses GGUF-loaded models (they are flagged as quantized), so the state dict and
    a config without `quantization_config` are written by hand. The cache location follows MASA_CACHE.
    """
    model_info = packaged_model(source.packaged)
    target = bundled_cache_dir(model_info.name)
    if (target / ".complete").is_file():
        return target
    gguf = ensure_gguf(model_info, progress)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        from rich.console import Console

        Console(stderr=True).print(
            f"[dim]Converting {model_info.gguf_file} to safetensors in {target} ({model_info.conversion})...[/]"
        )
    # transformers' GGUF reader draws its own tqdm bar on stderr, which no logging switch turns off: without
    # progress, keep stderr for what the user must see (one-line errors, JSON consumers' logs).
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **weight_loading(torch.float32)
        )
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared storage
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = model_info.origin
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(model_info.gguf_file + "\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def read_config(source: ModelSource) -> tuple[object, str, dict]:
    """The transformers config of a resolved model, without reading weights: (config, location, from_pretrained
    kwargs). The bundled model reads its converted copy when it exists, else the GGUF metadata."""
    from transformers import AutoConfig

    if source.kind == "compressed":
        raise UserError(
            f"'{source.spec}' is already a masa-compress checkpoint: run `masa-compress show {source.spec}`"
        )
    kwargs: dict = {}
    location = source.location
    if source.kind == "bundled":
        converted = bundled_cache_dir(source.packaged)
        if (converted / ".complete").is_file():
            location = str(converted)
        else:
            kwargs["gguf_file"] = source.gguf_file
    elif source.kind == "gguf":
        kwargs["gguf_file"] = source.gguf_file
    elif source.kind == "hub":
        check_hub_model(source)  # without network: one line at once, or the local cache (`local_only`)
        kwargs.update({"revision": source.revision} if source.revision else {})
        kwargs.update({"local_files_only": True} if source.local_only else {})
    read = (location, sorted(kwargs.items()))
    if source._config is not None and source._config[0] == read:
        return copy.deepcopy(source._config[1]), location, kwargs
    try:
        config = AutoConfig.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as err:
        if source.kind == "hub":
            raise UserError(
                f"could not fetch '{location}' from the Hugging Face hub (no network, gated model, or wrong id): "
                "download it elsewhere and pass the local directory"
            ) from err
        raise UserError(
            f"could not read the model config in '{location}': {str(err).splitlines()[0]}"
        ) from err
    check_architecture(config, source.spec)
    source._config = (read, copy.deepcopy(config))
    return config, location, kwargs


def model_shapes(source: ModelSource) -> dict | None:
    """The shapes of a resolved model that its settings follow (`model_defaults`), without reading weights: a
    packaged model's and a hub model's from their recipe's `shapes` (offline, exactly: `tests/test_recipe_shapes`),
    else from its config (a local folder's config.json, a GGUF's metadata, a hub model's config). None for a
    masa-compress checkpoint (nothing to compress)."""
    from compressor.api.model_defaults import config_shapes

    if source.kind == "compressed":
        return None
    recipe = builtin_recipe(source.packaged) if source.kind == "bundled" else shapes_recipe(source)
    if recipe is not None and recipe.shapes is not None:
        return recipe.shapes.model_dump()
    return config_shapes(read_config(source)[0])


def shapes_recipe(source: ModelSource) -> Recipe | None:
    """The recipe whose `shapes` describe a hub model (its own, or the built-in recipe of that hub id), or a
    packaged model whose registry parts have not been fetched yet (`plan` does not download 1 GB to count)."""
    if source.kind == "bundled" and not (Path(source.location) / source.gguf_file).is_file():
        return source.recipe if source.recipe is not None and source.recipe.shapes is not None else None
    if source.kind != "hub":
        return None
    if source.recipe is not None:
        return source.recipe if source.recipe.shapes is not None else None
    if source.revision:
        return None
    return next((r for r in map(builtin_recipe, builtin_recipe_names()) if r.model == source.location), None)


def recipe_config(recipe: Recipe | None):
    """A transformers config built from a recipe's `shapes` (the model's published config values): what `plan`
    reads for a hub model, offline. None when the recipe carries no shapes."""
    if recipe is None or recipe.shapes is None:
        return None
    from transformers import AutoConfig

    shapes = recipe.shapes.model_dump()
    config = AutoConfig.for_model(shapes.pop("model_type"), **shapes)
    check_architecture(config, f"recipe {recipe.name}")
    return config


def _quiet_transformers() -> None:
    """Our own progress bars cover loading; transformers' per-tensor bars would interleave with them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_model(
    source: ModelSource | str,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> LoadedModel:
    """Load a resolved model (and its tokenizer) on the chosen device and dtype, in eval mode."""
    if isinstance(source, str):
        source = resolve_model(source)
    _quiet_transformers()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    start = time.perf_counter()
    if source.kind == "compressed":
        from compressor.checkpoint import load_compressed

        model, tokenizer = load_compressed(
            source.location, device=torch_device, dtype=torch_dtype, with_tokenizer=True
        )
        return LoadedModel(model, tokenizer, source, torch_device, torch_dtype, time.perf_counter() - start)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "bundled":
        bundled_model_dir(source, progress)  # converted once; later loads read plain safetensors
    config, location, kwargs = read_config(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs, **weight_loading(torch_dtype))
    except OSError as err:
        raise UserError(f"could not load the model from '{location}': {str(err).splitlines()[0]}") from err
    model.to(torch_device)
    model.eval()
    return LoadedModel(model, tokenizer, source, torch_device, torch_dtype, time.perf_counter() - start)


ENGINES = ("transformers", "llama.cpp")


def gguf_path(source: ModelSource, progress: bool = True) -> Path:
    """The GGUF file of a `gguf` or `bundled` source (a packaged model's assembled from its parts if needed)."""
    if source.kind == "bundled":
        return ensure_gguf(packaged_model(source.packaged), progress)
    return Path(source.location) / source.gguf_file


def load_with_llama_cpp(
    source: ModelSource, context: int, progress: bool = True, flash_attention: bool = False
) -> LoadedModel:
    """A GGUF file (a user's, an export, a packaged model's) run by llama.cpp, behind the faces evaluation reads
    (`evaluation/llama_cpp.py`; `flash_attention`: llama.cpp's, faster and not exact)."""
    from compressor.evaluation.llama_cpp import LlamaCppCausalLM, LlamaCppTokenizer, build_note

    if source.kind not in ("gguf", "bundled"):
        raise UserError(
            f"--engine llama.cpp runs GGUF files and '{source.spec}' is not one: write one with "
            f"`masa-compress export {source.spec} OUT.gguf`"
        )
    path = gguf_path(source, progress)
    check_context(path, context)
    if (slower := build_note()) is not None:
        note(f"[yellow]note:[/] {slower}", progress)
    start = time.perf_counter()
    model = LlamaCppCausalLM(path, context, flash_attention=flash_attention)
    tokenizer = LlamaCppTokenizer(model.server, path)
    cpu = torch.device("cpu")
    return LoadedModel(model, tokenizer, source, cpu, torch.float32, time.perf_counter() - start)


def check_context(path: Path, context: int) -> None:
    """A one-line error where the evaluation windows are longer than the context the GGUF says its model was
    trained for (llama.cpp refuses such a window at the first request)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    architecture = fields["general.architecture"].contents() if "general.architecture" in fields else ""
    trained = fields.get(f"{architecture}.context_length")
    check_window_fits(path.name, context, None if trained is None else int(trained.contents()))


def check_window_fits(name: str, window: int, trained: int | None) -> None:
    """A one-line error where evaluation windows of `window` tokens are longer than the context `trained` of the
    model `name` (a GGUF's `context_length`, a config's `max_position_embeddings`; None: unknown, no check)."""
    if trained is not None and window > trained:
        raise UserError(
            f"{name}: the evaluation windows ({window} tokens) are longer than the model's context "
            f"({trained} tokens): evaluate with windows of at most that (--seq-len, --eval-seq-len)"
        )


if __name__ == "__main__":
    # `python -m compressor.api.model_loading`: the set-up step that converts the bundled GGUF once (make install), so that
    # no later command or test pays for it or prints its conversion bars.
    bundled_model_dir(resolve_model("smollm2-135m"), progress=True)
