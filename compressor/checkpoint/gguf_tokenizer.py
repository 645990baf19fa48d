"""A GGUF file's tokenizer fields (`tokenizer.*`: vocabulary, token types, merges, the pre-tokenizer's name, special
tokens, chat template), from a GGUF of the same model or from a Hugging Face folder's `tokenizer.json` /
`tokenizer_config.json`.

From a folder the fields are the ones llama.cpp's own converter writes (`convert_hf_to_gguf.py`, whose model
classes live in `conversion/` of the llama.cpp sources): `tokenizer.ggml.model` `gpt2` for a byte-level BPE
tokenizer (its `_set_vocab_gpt2`: the vocabulary and token types of `get_vocab_base`, the pre-tokenizer named by
the hash of `get_vocab_base_pre`, `bpe_pre_tokenizers.py`), `llama` for a SentencePiece-style BPE with byte
fallback (its `_set_vocab_llama_hf`). Merges, special token ids, `add_bos`/`add_eos` and the chat template come from
gguf-py's `gguf.vocab.SpecialVocab`, and the SentencePiece-style vocabulary from its `gguf.vocab.LlamaHfVocab`:
llama.cpp's own code, shipped in the `gguf` package this tool depends on. Only the ~30 lines of `get_vocab_base`
are restated here, because the converter itself ships in no wheel (it needs llama.cpp's source tree).
A tokenizer llama.cpp would not recognize either (another pre-tokenizer, a `tokenizer.model` alone) fails in one
line naming `--tokenizer-from`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from compressor.runtime.errors import UserError

FLAG = "--tokenizer-from MODEL.gguf (a GGUF of the same model)"
#: Families llama.cpp's converter handles as `LlamaModel` (`conversion/llama.py`): their tokenizer_config's
#: `add_prefix_space` is written, and a byte-fallback BPE goes through `LlamaHfVocab`.
LLAMA_CONVERTER = ("llama", "mistral", "mixtral", "smollm3")


@dataclass(frozen=True)
class TokenizerField:
    """One `tokenizer.*` key-value of a GGUF file, with its GGUF value types."""

    key: str
    value: Any
    type: Any  # gguf.GGUFValueType
    sub_type: Any = None  # of an array's items

    def write(self, writer) -> None:
        writer.add_key_value(self.key, self.value, self.type, sub_type=self.sub_type)


def tokenizer_fields(source: Path, fix: str = f"pass {FLAG}") -> list[TokenizerField]:
    """The tokenizer fields for a GGUF written with the tokenizer of `source`: a GGUF file (copied) or a Hugging
    Face folder (converted as llama.cpp's converter converts it). `fix`: what a refusal tells the user to do."""
    if source.is_dir():
        return fields_from_hf(source, fix)
    return fields_from_gguf(source)


def fields_from_gguf(path: Path) -> list[TokenizerField]:
    """The `tokenizer.*` fields of a GGUF file, with their own value types."""
    import gguf

    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file to copy the tokenizer from: pass --tokenizer-from")
    reader = gguf.GGUFReader(str(path))
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            fields.append(TokenizerField(name, field.contents(), value_type, sub_type))
    if not any(f.key == "tokenizer.ggml.tokens" for f in fields):
        raise UserError(
            f"{path}: holds no tokenizer (no tokenizer.ggml.tokens): pass another --tokenizer-from"
        )
    return fields


def fields_from_hf(folder: Path, fix: str = f"pass {FLAG}") -> list[TokenizerField]:
    """The fields llama.cpp's converter writes for the tokenizer of a Hugging Face folder, or a one-line error
    ending in `fix`. Converted once per folder and tokenizer file in a process (an export checks the folder before
    any weight is read, then writes the file and, under a budget, counts its bytes: one conversion serves all)."""
    return list(_converted(folder, _stamps(folder), fix))


def _stamps(folder: Path) -> tuple:
    """The modification times of the files a conversion reads (None: absent): a changed file converts again."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "config.json")
    return tuple((folder / n).stat().st_mtime_ns if (folder / n).is_file() else None for n in names)


@functools.cache
def _converted(folder: Path, stamps: tuple, fix: str) -> tuple[TokenizerField, ...]:
    """`fields_from_hf`'s conversion, keyed by the folder, its files' `_stamps` and the refusal's fix."""
    import gguf

    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise UserError(
            f"{folder}: no tokenizer.json (llama.cpp's converter reads a fast tokenizer's file): {fix}"
        )
    if (folder / "tokenizer.model").is_file():  # the converter would read it with sentencepiece first
        raise UserError(
            f"{folder}: a SentencePiece tokenizer.model: GGUF export converts BPE tokenizers: {fix}"
        )
    model = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(
            f"{folder}: a {model.get('type', 'unknown')} tokenizer: GGUF export converts BPE tokenizers: {fix}"
        )
    writer = gguf.GGUFWriter(None, "llama")  # a writer that only collects the key-values
    llama_like = _config(folder).get("model_type") in LLAMA_CONVERTER
    if llama_like:
        prefix = _tokenizer_config(folder).get("add_prefix_space")
        if prefix is not None:
            writer.add_add_space_prefix(prefix)
    if llama_like and model.get("byte_fallback"):
        _add_llama_hf(writer, folder)
    else:
        _add_gpt2(writer, folder, fix)
    return tuple(
        TokenizerField(key, value.value, value.type, value.sub_type)
        for key, value in writer.kv_data[0].items()
        if key.startswith("tokenizer.")
    )


def _add_gpt2(writer, folder: Path, fix: str) -> None:
    """`_set_vocab_gpt2` of llama.cpp's converter: a byte-level BPE vocabulary."""
    import gguf

    tokens, token_types, pre = _vocab_base(folder, fix)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)


def _add_llama_hf(writer, folder: Path) -> None:
    """`_set_vocab_llama_hf` of llama.cpp's converter: a SentencePiece-style BPE with byte fallback."""
    import gguf

    vocab = gguf.LlamaHfVocab(folder)
    tokens, scores, token_types = zip(*vocab.all_tokens(), strict=True)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(token_types))
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _vocab_base(folder: Path, fix: str) -> tuple[list[str], list[int], str]:
    """`get_vocab_base` of llama.cpp's converter: (tokens, token types, pre-tokenizer name) of a BPE tokenizer."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    vocab_size = _config_vocab_size(folder) or len(tokenizer.vocab)
    pre = pre_tokenizer_name(tokenizer, folder, fix)
    reverse = {id_: token for token, id_ in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp assumes added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types, pre


def pre_tokenizer_name(tokenizer, folder: Path, fix: str = f"pass {FLAG}") -> str:
    """llama.cpp's name for the tokenizer's BPE pre-tokenizer (the converter's hash of `CHECK_TEXT`'s ids)."""
    from compressor.checkpoint.bpe_pre_tokenizers import CHECK_TEXT, PRE_TOKENIZERS

    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise UserError(
            f"{folder}: its BPE pre-tokenizer is not one llama.cpp recognizes (hash {digest[:12]}...): {fix}"
        )
    return PRE_TOKENIZERS[digest]


def _looks_special(token: str) -> bool:
    """`does_token_look_special` of llama.cpp's converter: added tokens some models fail to mark special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _config_vocab_size(folder: Path) -> int | None:
    """The model config's `vocab_size` (the embedding's rows, which may exceed the tokenizer's: padded)."""
    data = _config(folder)
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def _config(folder: Path) -> dict:
    return _json(folder / "config.json")


def _tokenizer_config(folder: Path) -> dict:
    return _json(folder / "tokenizer_config.json")


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
