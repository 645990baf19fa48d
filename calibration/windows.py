"""Token streams and fixed-length windows for calibration (stage 1) and perplexity evaluation.

Protocol (method.md): the text is tokenized once as one stream; evaluation uses consecutive
non-overlapping windows of ``T`` tokens; calibration uses ``N`` windows at seeded random positions.
A BOS token starts each window only where the tokenizer adds one by default
(:func:`bos_token_id_for`); it then takes one of the ``T`` positions, so a window holds ``T - 1``
text tokens. The stream itself never contains BOS tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from compressor.runtime.errors import UserError

#: Characters per tokenizer call. Large enough that the per-call overhead vanishes, small enough
#: that a batch of chunks is spread over the fast tokenizer's threads.
_CHUNK_CHARS = 100_000


def _chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut ``text`` into pieces of about ``chunk_chars`` whose tokenizations concatenate exactly.

    A cut is placed just before a whitespace run that contains a blank line and follows a letter
    or digit (``"...word|\\n\\nNext..."``). The regex pre-tokenizers of byte-level BPE models
    (GPT-2 and SmolLM2: ``\\s+(?!\\S)``; Llama 3 and Qwen: ``\\s*[\\r\\n]+``) never join a letter or
    digit with the whitespace after it, and treat a whitespace run the same at the start of a
    string as after a word, so the pieces give the ids of the whole text. (After punctuation the
    cut would not be safe: Llama 3 glues ``".\\n\\n"`` into one pre-token.) Tokenizers that
    prepend a space marker to every call (SentencePiece style) can differ by a token per cut,
    i.e. a few tokens per million characters. A text without a cut point stays one piece.
    """
    pieces = []
    start = 0
    while len(text) - start > chunk_chars:
        search = start + chunk_chars
        cut = -1
        while True:
            blank = text.find("\n\n", search)
            if blank < 0:
                break
            # Back up to the start of the whitespace run, so the run stays whole in the next piece.
            run_start = blank
            while run_start > start and text[run_start - 1].isspace():
                run_start -= 1
            if run_start > start and text[run_start - 1].isalnum():
                cut = run_start
                break
            # Skip the rest of this run and look for the next blank line.
            search = blank + 2
            while search < len(text) and text[search].isspace():
                search += 1
        if cut < 0:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def tokenize_documents(
    tokenizer: Any,
    documents: Sequence[str],
    add_bos: bool | None = None,
    *,
    chunk_chars: int = _CHUNK_CHARS,
) -> torch.LongTensor:
    """Tokenize documents joined by ``"\\n\\n"`` into one 1-D stream of token ids.

    The ids equal ``tokenizer("\\n\\n".join(documents), add_special_tokens=False)`` for byte-level
    BPE tokenizers (see :func:`_chunk_text`), computed in chunks: one giant string would run on one
    thread and trigger the "sequence longer than the maximum" warning.

    ``add_bos``: ``None`` or ``False`` (default) -- no BOS in the stream; the window builders add
    one per window where the tokenizer does (:func:`bos_token_id_for`). ``True`` -- prepend one
    BOS to the whole stream (for scoring it as a single sequence).
    """
    text = "\n\n".join(documents)
    pieces = _chunk_text(text, chunk_chars)
    # Special tokens are never added per chunk: a chunk boundary is not a sequence start.
    # verbose=False silences the max-length warning, which does not apply to a stream we window later.
    encoded = tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]
    ids = [token for piece_ids in encoded for token in piece_ids]
    if add_bos:
        if tokenizer.bos_token_id is None:
            raise ValueError("add_bos=True but the tokenizer has no BOS token")
        ids.insert(0, tokenizer.bos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def bos_token_id_for(tokenizer: Any) -> int | None:
    """The BOS id if this tokenizer adds a BOS token by default, else ``None``.

    Decided by behaviour, not by configuration flags: we encode ``"a"`` with the tokenizer's
    default special tokens and look at the first id. (``add_bos_token`` is not defined by every
    tokenizer class, and some define BOS without ever adding it, like SmolLM2.)
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return int(bos) if len(ids) > 0 and ids[0] == bos else None


def _as_stream(ids: Any) -> torch.Tensor:
    stream = torch.as_tensor(ids, dtype=torch.long)
    if stream.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(stream.shape)}")
    return stream


def _text_per_window(seq_len: int, bos_id: int | None) -> int:
    """Text tokens per window: ``seq_len``, less one position when each window starts with BOS."""
    need = 2 if bos_id is not None else 1
    if seq_len < need:
        raise UserError(
            f"window length {seq_len} is too short: use at least {need} tokens "
            f"({'BOS plus one text token' if bos_id is not None else 'one token'})"
        )
    return seq_len - (1 if bos_id is not None else 0)


def _with_bos(text_windows: torch.Tensor, bos_id: int | None) -> torch.Tensor:
    if bos_id is None:
        return text_windows.clone()  # never alias the caller's stream
    bos_column = torch.full((text_windows.shape[0], 1), bos_id, dtype=torch.long)
    return torch.cat([bos_column, text_windows], dim=1)


def evaluation_windows(
    ids: torch.Tensor,
    seq_len: int,
    max_tokens: int | None = None,
    bos_id: int | None = None,
) -> torch.LongTensor:
    """Consecutive non-overlapping windows ``(n, seq_len)`` over the stream, for perplexity.

    Window ``i`` holds text tokens ``[i*k, (i+1)*k)`` with ``k = seq_len`` (or ``seq_len - 1``
    after a leading ``bos_id``). ``max_tokens`` caps the text tokens used (the stream is cut
    there first); the incomplete last window is dropped, as in the usual protocol.
    """
    stream = _as_stream(ids)
    per_window = _text_per_window(seq_len, bos_id)
    if max_tokens is not None:
        if max_tokens < 1:
            raise UserError(
                f"the evaluation token cap must be positive (got {max_tokens}): raise it or remove it"
            )
        stream = stream[:max_tokens]
    n_windows = stream.numel() // per_window
    if n_windows == 0:
        capped = f" (capped at {max_tokens})" if max_tokens is not None and max_tokens < len(ids) else ""
        raise UserError(
            f"the evaluation text has {stream.numel()} tokens{capped} but one window of {seq_len} "
            f"needs {per_window}: pass a longer evaluation text or lower the sequence length"
        )
    return _with_bos(stream[: n_windows * per_window].view(n_windows, per_window), bos_id)


def calibration_windows(
    ids: torch.Tensor,
    n_samples: int,
    seq_len: int,
    seed: int,
    bos_id: int | None = None,
) -> torch.LongTensor:
    """``n_samples`` windows ``(n_samples, seq_len)`` at seeded random, non-overlapping positions.

    The stream is laid out as a grid of ``S = len // k`` non-overlapping slots of ``k`` text tokens
    (``k = seq_len``, or ``seq_len - 1`` after a leading ``bos_id``), shifted by a seeded random
    offset into the tokens the grid leaves over; the first ``n_samples`` slots of a seeded random
    permutation are taken, in that order. Same ids, sizes and seed -> same windows, on any machine
    (CPU ``torch.Generator``); and more samples with the same seed extend the earlier selection.
    """
    stream = _as_stream(ids)
    if n_samples < 1:
        raise UserError(f"the number of calibration samples must be at least 1 (got {n_samples}): raise it")
    per_window = _text_per_window(seq_len, bos_id)
    needed = n_samples * per_window
    if stream.numel() < needed:
        raise UserError(
            f"the calibration text has {stream.numel()} tokens but {n_samples} samples x {seq_len} "
            f"tokens need {needed}: lower the number of samples or the sequence length, or pass more text"
        )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    n_slots = stream.numel() // per_window
    spare = stream.numel() - n_slots * per_window
    offset = int(torch.randint(0, spare + 1, (1,), generator=generator))
    grid = stream[offset : offset + n_slots * per_window].view(n_slots, per_window)
    chosen = torch.randperm(n_slots, generator=generator)[:n_samples]
    return _with_bos(grid[chosen], bos_id)
