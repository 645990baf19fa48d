"""A GGUF file's tokenizer fields (`tokenizer.*`: vocabulary, token types, merges, the pre-tokenizer's name, special
tokens, chat template), from a GGUF of the same model or from a Hugging Face folder's `tokenizer.json` /
`tokenizer_config.json` / SentencePiece `tokenizer.model`.

From a folder the fields are the ones llama.cpp's own converter writes (`convert_hf_to_gguf.py`, whose model
classes live in `conversion/` of the llama.cpp sources): `tokenizer.ggml.model` `llama` for a SentencePiece
`tokenizer.model`, which the converter reads first for the Llama, Qwen2/Qwen3, Gemma and Phi-3 families (its
`_create_vocab_sentencepiece`, and Phi-3's own variant of it); `gpt2` for a byte-level BPE tokenizer (its
`_set_vocab_gpt2`: the vocabulary and token types of `get_vocab_base`, the pre-tokenizer named by the hash of
`get_vocab_base_pre`, `bpe_pre_tokenizers.py`); `llama` for a SentencePiece-style BPE with byte fallback in a
`tokenizer.json` (its `_set_vocab_llama_hf`). Merges, special token ids, `add_bos`/`add_eos` and the chat template
come from gguf-py's `gguf.vocab.SpecialVocab`, and the byte-fallback vocabulary from its `gguf.vocab.LlamaHfVocab`:
llama.cpp's own code, shipped in the `gguf` package this tool depends on. The converter itself ships in no wheel
(it needs llama.cpp's source tree), so its vocabulary steps that gguf-py lacks (`get_vocab_base`, about 30 lines,
and `_create_vocab_sentencepiece`, about 50, reading the model with the `sentencepiece` package as it does) are
restated here; a long test checks them field for field against the vendored converter.
A tokenizer llama.cpp would not recognize (another pre-tokenizer, a WordPiece or Unigram `tokenizer.json`) fails
in one line naming `--tokenizer-from`.
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
#: Families whose converter reads a SentencePiece `tokenizer.model` before anything else (`LlamaModel`,
#: `Qwen2Model` and `Qwen3Model`, the Gemma models, `Phi3MiniModel` unless its tokenizer class is GPT-2's); the
#: others (OLMo 2, Qwen3-MoE) read `tokenizer.json` alone, as here.
SENTENCEPIECE_FIRST = (*LLAMA_CONVERTER, "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
#: Gemma's converters write `add_space_prefix` false after the SentencePiece vocabulary.
NO_SPACE_PREFIX = ("gemma", "gemma2", "gemma3_text")
#: Gemma (the first)'s converter names these CodeGemma tokens for every Gemma model (its own TODO says so).
GEMMA_FILL_IN_MIDDLE = {"prefix": 67, "suffix": 69, "middle": 68, "fsep": 70, "eot": 107}


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
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "added_tokens.json", "config.json")
    return tuple((folder / n).stat().st_mtime_ns if (folder / n).is_file() else None for n in names)


@functools.cache
def _converted(folder: Path, stamps: tuple, fix: str) -> tuple[TokenizerField, ...]:
    """`fields_from_hf`'s conversion, keyed by the folder, its files' `_stamps` and the refusal's fix."""
    import gguf

    model_type = _config(folder).get("model_type")
    writer = gguf.GGUFWriter(None, "llama")  # a writer that only collects the key-values
    llama_like = model_type in LLAMA_CONVERTER
    if llama_like:
        prefix = _tokenizer_config(folder).get("add_prefix_space")
        if prefix is not None:
            writer.add_add_space_prefix(prefix)
    if _reads_sentencepiece(folder, model_type):
        _add_sentencepiece(writer, folder, model_type, fix)
    else:
        _add_tokenizer_json(writer, folder, llama_like, fix)
    return tuple(
        TokenizerField(key, value.value, value.type, value.sub_type)
        for key, value in writer.kv_data[0].items()
        if key.startswith("tokenizer.")
    )


def _reads_sentencepiece(folder: Path, model_type: str | None) -> bool:
    """Whether llama.cpp's converter of this family reads the folder's `tokenizer.model`."""
    if model_type not in SENTENCEPIECE_FIRST or not (folder / "tokenizer.model").is_file():
        return False
    return model_type != "phi3" or _tokenizer_config(folder).get("tokenizer_class") != "GPT2Tokenizer"


def _add_tokenizer_json(writer, folder: Path, llama_like: bool, fix: str) -> None:
    """A fast tokenizer's `tokenizer.json`: a byte-fallback BPE of the Llama families as `llama`, any other
    byte-level BPE as `gpt2`."""
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise UserError(
            f"{folder}: no tokenizer.json (llama.cpp's converter reads a fast tokenizer's file): {fix}"
        )
    model = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(
            f"{folder}: a {model.get('type', 'unknown')} tokenizer: GGUF export converts BPE tokenizers: {fix}"
        )
    if llama_like and model.get("byte_fallback"):
        _add_llama_hf(writer, folder)
    else:
        _add_gpt2(writer, folder, fix)


def _add_sentencepiece(writer, folder: Path, model_type: str, fix: str) -> None:
    """`_set_vocab_sentencepiece` of llama.cpp's converter (for Phi-3, `Phi3MiniModel.set_vocab`), with what the
    Gemma converters write after it."""
    import gguf

    tokens, scores, token_types = _sentencepiece_pieces(folder, fix)
    if model_type == "phi3":
        _phi3_added_tokens(folder, tokens, scores, token_types)
    else:
        _added_tokens(folder, tokens, scores, token_types)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    if model_type == "gemma":  # written again over the first: a writer of its own keeps gguf's warning away
        fill = gguf.SpecialVocab(folder, special_token_types=list(GEMMA_FILL_IN_MIDDLE))
        for name, token_id in GEMMA_FILL_IN_MIDDLE.items():
            fill._set_special_token(name, token_id)
        fill.chat_template = None
        fill_writer = gguf.GGUFWriter(None, "llama")
        fill.add_to_gguf(fill_writer, quiet=True)
        writer.kv_data[0].update(fill_writer.kv_data[0])
    if model_type in NO_SPACE_PREFIX:
        writer.add_add_space_prefix(False)


def _sentencepiece_pieces(folder: Path, fix: str) -> tuple[list[bytes], list[float], list[int]]:
    """The first half of `_create_vocab_sentencepiece`: every id up to the config's vocabulary size, its piece,
    score and type (`[PADi]`, unused, where the model has no piece)."""
    import gguf

    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise UserError(
            f"{folder}: reading its SentencePiece tokenizer.model needs the sentencepiece package "
            f"(pip install sentencepiece), or {fix}"
        ) from None
    processor = SentencePieceProcessor()
    try:
        processor.LoadFromFile(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as error:
        raise UserError(f"{folder / 'tokenizer.model'}: not a SentencePiece model ({error}): {fix}") from None
    size = _config_vocab_size(folder) or processor.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores, types = [-10000.0] * size, [int(gguf.TokenType.UNUSED)] * size
    for i in range(min(size, processor.vocab_size())):
        tokens[i], scores[i] = processor.IdToPiece(i).encode(), processor.GetScore(i)
        types[i] = int(_piece_type(processor, i))
    return tokens, scores, types


def _piece_type(processor, i: int):
    import gguf

    for is_type, token_type in (
        (processor.IsUnknown, gguf.TokenType.UNKNOWN),
        (processor.IsControl, gguf.TokenType.CONTROL),
        (processor.IsUnused, gguf.TokenType.UNUSED),
        (processor.IsByte, gguf.TokenType.BYTE),
    ):
        if is_type(i):
            return token_type
    return gguf.TokenType.NORMAL


def _added_tokens(folder: Path, tokens: list, scores: list, types: list) -> None:
    """The second half of `_create_vocab_sentencepiece`: `added_tokens.json`'s tokens as user-defined, then
    tokenizer_config's `added_tokens_decoder` (control where special or special-looking, else user-defined with
    SentencePiece's space pre-normalized), each scored -1000; ids past the vocabulary are skipped."""
    import gguf

    for text, i in _json(folder / "added_tokens.json").items():
        if i < len(tokens):
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, int(gguf.TokenType.USER_DEFINED)
    for key, data in _tokenizer_config(folder).get("added_tokens_decoder", {}).items():
        i, text = int(key), data["content"]
        if i >= len(tokens):
            continue
        if data.get("special") or _looks_special(text):
            types[i] = int(gguf.TokenType.CONTROL)
        else:
            text, types[i] = text.replace("\u2581", " "), int(gguf.TokenType.USER_DEFINED)
        tokens[i], scores[i] = text.encode(), -1000.0


def _phi3_added_tokens(folder: Path, tokens: list, scores: list, types: list) -> None:
    """Phi-3's converter: tokenizer_config's `added_tokens_decoder`, then tokenizer.json's `added_tokens`, each
    user-defined (control where marked special) and scored -1000, with no renaming."""
    import gguf

    decoder = _tokenizer_config(folder).get("added_tokens_decoder", {})
    added = [(int(key), data) for key, data in decoder.items()]
    added += [(int(data["id"]), data) for data in _json(folder / "tokenizer.json").get("added_tokens", [])]
    for i, data in added:
        if i < len(tokens):
            tokens[i], scores[i] = data["content"].encode(), -1000.0
            special = data.get("special")
            types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)


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
