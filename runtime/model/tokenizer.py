"""Tokenizers: the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), else UTF-8 bytes.

Real DeepSeek V4 checkpoints ship a byte-level BPE `tokenizer.json`; `dsv4 synth` writes one
too (runtime.synth.tokenizer), so the synthetic presets take the same path. A checkpoint
without one falls back to the byte tokenizer (ids = bytes shifted past bos/eos) with a
warning. A tokenizer.json that does not load, or whose ids do not fit the model's vocabulary,
is one line (TokenizerError) at registration's check phase, never a traceback mid-request.

Both tokenizers answer the same small interface:
    encode(text)              ids of raw completion text; special tokens in it are recognised
    encode_plain(text)        ids of untrusted text (chat content): special-token strings in it
                              are ordinary text, so a user cannot forge a turn marker
    special_id(token)         the id of a special token, or None where it has none
    decode(ids)               text, special tokens skipped
    bos_id, eos_id, kind, vocab_size
    max_token_chars           the most characters of text one token covers: a text of n
                              characters is at least n / max_token_chars tokens
"""

from __future__ import annotations

import os
from pathlib import Path

from store import safeio
from store.errors import UserError

TOKENIZER_NAME = "tokenizer.json"
# The V4 tokenizer's specials (fullwidth bars, U+2581 for spaces), shared with the chat template.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END)

BOS, EOS = 0, 1  # ids 0 and 1 are bos/eos in the V4 config
OFFSET = 2  # the byte tokenizer's first byte id
# A V4 tokenizer.json is ~8 MiB; far larger is hostile or not a tokenizer.
MAX_TOKENIZER_BYTES = 256 << 20


class TokenizerError(UserError):
    """tokenizer.json exists but cannot serve: unreadable, malformed, or too large a vocabulary."""


class ByteTokenizer:
    """UTF-8 bytes shifted past bos/eos: the fallback for a checkpoint without tokenizer.json."""

    kind = "bytes"
    max_token_chars = 1  # a character is one to four bytes, each a token

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + OFFSET:
            raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id = BOS, EOS

    def encode(self, text: str) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    encode_plain = encode  # no special token has a text form here

    def special_id(self, token: str) -> int | None:
        return {BOS_TOKEN: BOS, EOS_TOKEN: EOS}.get(token)

    def decode(self, ids: list[int]) -> str:
        """Ids outside the byte range (specials, the rest of the vocab) decode to nothing."""
        data = bytes(i - OFFSET for i in ids if OFFSET <= i < 256 + OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from the checkpoint's tokenizer.json."""

    kind = "tokenizer.json"

    def __init__(self, tok, path: Path, vocab_size: int):
        self._tok = tok
        self.path = path
        self.vocab_size = vocab_size
        # `encode_special_tokens` is a flag on the Rust object: a second object holds the
        # plain-text setting, so no request waits for another's tokenizing (a lock between them
        # made a 4 MiB prompt's seconds everyone's)
        self._plain = type(tok).from_str(tok.to_str())
        self._plain.encode_special_tokens = True
        tok.encode_special_tokens = False
        self.bos_id = self._id_or(BOS_TOKEN, BOS)
        self.eos_id = self._id_or(EOS_TOKEN, EOS)
        # a token's string (byte-level: one character per byte) is at least as long as the text
        # it covers
        self.max_token_chars = max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)

    def _id_or(self, token: str, default: int) -> int:
        i = self._tok.token_to_id(token)
        return default if i is None else i

    def _encode(self, text: str, specials: bool) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL while it works, so a long text
        # tokenized in a worker thread no longer stalls the service's event loop (1 MB of text
        # on 2 cores: the loop's longest pause 3.7 s with encode, 0.25 s with encode_batch)
        tok = self._tok if specials else self._plain
        return tok.encode_batch([text], add_special_tokens=specials)[0].ids

    def encode(self, text: str) -> list[int]:
        return self._encode(text, True)

    def encode_plain(self, text: str) -> list[int]:
        return self._encode(text, False)

    def special_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def load_tokenizer(model_dir: str | Path, vocab_size: int) -> tuple[ByteTokenizer | HFTokenizer, str | None]:
    """The checkpoint's tokenizer and a warning (None when tokenizer.json loaded).

    No tokenizer.json: the byte tokenizer and a warning saying so. A tokenizer.json that is not
    a regular file, does not parse, or holds ids at or past `vocab_size`: TokenizerError, one
    line naming the file. Registration calls this in its check phase.
    """
    path = Path(model_dir) / TOKENIZER_NAME
    if not os.path.lexists(path):
        return ByteTokenizer(vocab_size), (f"{model_dir}: no {TOKENIZER_NAME}; text is tokenized as UTF-8 bytes "
                                           f"(clients may send token ids instead)")
    try:
        raw = safeio.read_regular(path, MAX_TOKENIZER_BYTES)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror or e}); fix or remove it") from None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the Rust parser raises plain Exception subclasses
        raise TokenizerError(f"{path}: not a loadable tokenizer.json ({_first_line(e)}); "
                             f"fix or remove it") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise TokenizerError(f"{path}: holds token id {top} ({size} tokens) but config.json's vocab_size is "
                             f"{vocab_size}; the tokenizer does not belong to this checkpoint")
    return HFTokenizer(tok, path, vocab_size), None


class IncrementalDecoder:
    """Text of a growing token sequence, emitted piece by piece and never mid-character.

    Byte-level tokens can split a UTF-8 character; decoding each token alone would emit
    replacement characters. Text is only released once it no longer ends in an incomplete
    character, and only a short window of recent tokens is re-decoded per step.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids before this are settled into self.text
        self._read = 0  # ids[_prefix:_read] decode to the settled tail
        self.text = ""

    def push(self, token: int) -> str:
        """Append a token; the newly settled text (possibly empty)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        now = self.tokenizer.decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing visible yet, or an incomplete character: wait for its bytes
        new = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Whatever is still held back once the sequence ended (an incomplete last character)."""
        whole = self.tokenizer.decode(self.ids)
        new = whole[len(self.text):] if whole.startswith(self.text) else ""
        self.text += new
        self._prefix = self._read = len(self.ids)
        return new
