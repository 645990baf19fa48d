"""A GGUF file run by llama.cpp itself (the `xllamacpp` wheel: `pip install masa-compress[gguf]`), behind the
two faces the tool's evaluation reads: a causal LM whose forward returns logits, and a tokenizer.

llama.cpp's server returns per-token hidden states (its embedding endpoint with pooling `none`: the output of
the final norm); the logits are those states times the file's own output matrix (or its embedding when tied),
read from the GGUF and dequantized, then soft-capped where llama.cpp's graph caps them (`OutputHead`). Every
layer runs in llama.cpp; the last matrix product and the capping run in torch.

Exactness: by default flash attention is off and the KV cache is f32, so that an f32 file gives transformers'
log-probabilities (within 1e-3 per token, tested): this scores the file, not llama.cpp's speed options.
`flash_attention=True` (`eval --flash-attention`) runs llama.cpp's CPU flash attention, KV cache still f32: the
attention faster (what it saves: `benchmarks/results/eval-speed-smollm2-135m.json`); on a float file each
token's log-probability within 1e-2 nats of the exact one (tested on the f32 file); on a quantized file, whose
products llama.cpp computes on activations rounded to 8 bits, single tokens move by as much as that rounding
moves them, the perplexity by hundredths of a percent (docs/options.md).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from compressor.runtime.errors import UserError

INSTALL_HINT = "pip install 'masa-compress[gguf]' (the xllamacpp wheel)"


def require_llama_cpp():
    """The `xllamacpp` module, or a one-line error naming the extra that installs it."""
    try:
        import xllamacpp
    except ImportError:
        raise UserError(f"--engine llama.cpp needs llama.cpp's Python wheel: {INSTALL_HINT}") from None
    return xllamacpp


def unused_avx512(system_info: str, cpu_capability: str) -> bool:
    """Whether this CPU has AVX-512 (`cpu_capability`: torch's `get_cpu_capability()`) and the llama.cpp build
    (`system_info`: llama.cpp's own `get_system_info()`) does not use it: the prebuilt wheel is built for AVX2."""
    return cpu_capability.startswith("AVX512") and "AVX512 = 1" not in system_info


def unused_amx(system_info: str, cpu_flags: set[str]) -> bool:
    """Whether this CPU has AMX's integer tiles (`cpu_flags`: the kernel's flags, `amx_int8`) and the llama.cpp
    build does not use them (quantized files' matrix products: BENCHMARKS.md section 7)."""
    return "amx_int8" in cpu_flags and "AMX_INT8 = 1" not in system_info


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere: nothing is then said of AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build_note() -> str | None:
    """A line for the user where the installed llama.cpp leaves this CPU's AVX-512 or AMX unused, else None."""
    system_info = require_llama_cpp().get_system_info()
    unused = [
        name
        for name, missing in (
            ("AVX-512", unused_avx512(system_info, torch.backends.cpu.get_cpu_capability())),
            ("AMX tiles", unused_amx(system_info, cpu_flags())),
        )
        if missing
    ]
    if not unused:
        return None
    return (
        f"llama.cpp's build here does not use this CPU's {' or '.join(unused)} (the prebuilt wheel is built for "
        "AVX2): `make llama-cpp-native` in the repository builds it for this CPU (docs/options.md, --engine)"
    )


class LlamaCppServer:
    """llama.cpp's server in this process, on a local port, for one GGUF file; `close()` stops it."""

    def __init__(
        self,
        gguf_path: str | os.PathLike,
        context: int,
        threads: int | None = None,
        embedding: bool = True,
        flash_attention: bool = False,
    ):
        """`embedding`: serve hidden states (scoring); off, the server only generates (timing its decode).
        `flash_attention`: llama.cpp's CPU kernel, KV cache still f32 (faster; not exact, see the module)."""
        xl = require_llama_cpp()
        path = Path(gguf_path)
        if not path.is_file():
            raise UserError(f"{path}: no such GGUF file")
        params = xl.CommonParams()
        params.model.path = str(path)
        params.embedding = embedding
        params.pooling_type = xl.llama_pooling_type.LLAMA_POOLING_TYPE_NONE
        params.embd_normalize = -1  # the states as they are
        params.n_ctx = params.n_batch = params.n_ubatch = int(context)
        params.flash_attn_type = getattr(
            xl.llama_flash_attn_type, f"LLAMA_FLASH_ATTN_TYPE_{'ENABLED' if flash_attention else 'DISABLED'}"
        )
        params.cache_type_k = params.cache_type_v = xl.ggml_type.GGML_TYPE_F32
        params.warmup = False
        threads = threads or os.cpu_count() or 1
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = int(threads)
        params.verbosity = -1
        self.path = path
        try:
            self._server = xl.Server(params)
        except RuntimeError as err:  # its reason went to llama.cpp's log, which is off
            raise UserError(
                f"{path}: llama.cpp could not load it ({err}): check that it is a complete GGUF of a model "
                "llama.cpp runs (`masa-compress export` writes one)"
            ) from None
        self.address = self._server.listening_address

    def post(self, endpoint: str, body: dict):
        request = urllib.request.Request(
            self.address + endpoint,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as err:  # the server's own reason, not a traceback of the transport
            payload = json.loads(err.read() or b"{}") or {"error": {"message": f"HTTP {err.code}"}}
        if isinstance(payload, dict) and "error" in payload:
            raise RuntimeError(f"llama.cpp {endpoint}: {payload['error'].get('message', payload['error'])}")
        return payload

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """The final-norm output at every position of `ids`: (len(ids), hidden)."""
        payload = self.post("/embedding", {"content": [int(i) for i in ids]})
        return np.asarray(payload[0]["embedding"], dtype=np.float32)

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": False})["tokens"]

    def generate(self, ids: list[int], max_new_tokens: int) -> str:
        """Greedy continuation of `ids`, as text."""
        return self.complete(ids, max_new_tokens)["content"]

    def complete(self, ids: list[int], max_new_tokens: int) -> dict:
        """llama.cpp's whole answer to a greedy completion of `ids` (exactly `max_new_tokens`, end of text or not):
        the text and its `timings` (prompt and predicted tokens per second). The prompt is not reused from an
        earlier call, so each call times its own prefill."""
        body = {"prompt": [int(i) for i in ids], "n_predict": int(max_new_tokens), "temperature": 0}
        return self.post("/completion", body | {"cache_prompt": False, "ignore_eos": True})

    def close(self) -> None:
        self._server = None


#: llama.cpp's graph caps the logits after the output matrix (`cap * tanh(logits / cap)`) by the file's
#: `final_logit_softcapping`; where the file has no such key Gemma 2's caps at llama.cpp's default, 30
#: (`llama-hparams.h`), and Gemma 3's (like every architecture the export writes) not at all.
DEFAULT_FINAL_SOFTCAP = {"gemma2": 30.0}


class OutputHead(NamedTuple):
    """What llama.cpp's graph does after the final norm: the output matrix (its embedding where tied), dequantized
    to fp32 (vocab, hidden), and the soft-capping of the logits (None: none)."""

    matrix: torch.Tensor
    softcap: float | None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.matrix.T
        return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)


def read_output_head(gguf_path: str | os.PathLike) -> OutputHead:
    """The GGUF's `OutputHead`; a file whose architecture scales its logits in a way not done here (a
    `logit_scale` key: Granite, Command R, Grok) is refused in one line rather than scored wrong."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if tensor is None:
        raise UserError(f"{gguf_path}: has neither output.weight nor token_embd.weight: not a language model")
    architecture = _field(reader.fields, "general.architecture")
    if f"{architecture}.logit_scale" in reader.fields:
        raise UserError(
            f"{gguf_path}: llama.cpp's {architecture} scales its logits, which this evaluation does not: "
            "score it with llama.cpp's own llama-perplexity"
        )
    softcap = _field(reader.fields, f"{architecture}.final_logit_softcapping")
    if softcap is None:
        softcap = DEFAULT_FINAL_SOFTCAP.get(architecture)
    values = quants.dequantize(tensor.data, tensor.tensor_type)
    matrix = torch.from_numpy(
        np.array(values, dtype=np.float32)
    )  # a copy: the reader's memory map is read-only
    return OutputHead(matrix, float(softcap) if softcap else None)


class LlamaCppCausalLM(nn.Module):
    """A GGUF file run by llama.cpp, as a causal LM: `model(input_ids=ids).logits` is (B, T, vocab)."""

    def __init__(
        self,
        gguf_path: str | os.PathLike,
        context: int,
        threads: int | None = None,
        flash_attention: bool = False,
    ):
        super().__init__()
        self.flash_attention = flash_attention
        self.server = LlamaCppServer(gguf_path, context, threads, flash_attention=flash_attention)
        head = read_output_head(gguf_path)
        self.output = nn.Parameter(head.matrix, requires_grad=False)
        self.softcap = head.softcap

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, **_) -> SimpleNamespace:
        states = [torch.from_numpy(self.server.hidden_states(row.tolist())) for row in input_ids.cpu()]
        hidden = torch.stack(states).to(self.output.device)
        return SimpleNamespace(logits=OutputHead(self.output, self.softcap).logits(hidden))


class LlamaCppTokenizer:
    """llama.cpp's own tokenizer of the file (what it serves with), with the calls the windows need."""

    def __init__(self, server: LlamaCppServer, gguf_path: str | os.PathLike):
        import gguf

        self.server = server
        reader = gguf.GGUFReader(str(gguf_path))
        fields = reader.fields
        tokens = fields["tokenizer.ggml.tokens"].contents()
        self._vocab = {token: index for index, token in enumerate(tokens)}
        self.bos_token_id = _field(fields, "tokenizer.ggml.bos_token_id")
        self.eos_token_id = _field(fields, "tokenizer.ggml.eos_token_id")
        self._adds_bos = bool(_field(fields, "tokenizer.ggml.add_bos_token"))

    def __call__(self, text, add_special_tokens: bool = True, **_) -> dict:
        pieces = [text] if isinstance(text, str) else list(text)
        ids = [self.server.tokenize(piece) for piece in pieces]
        if add_special_tokens and self._adds_bos and self.bos_token_id is not None:
            ids = [[self.bos_token_id, *row] for row in ids]
        return {"input_ids": ids[0] if isinstance(text, str) else ids}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __len__(self) -> int:
        return len(self._vocab)


def _field(fields, name: str):
    return fields[name].contents() if name in fields else None
