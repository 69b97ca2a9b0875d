"""A byte-level tokenizer for synthetic checkpoints: UTF-8 bytes shifted past two specials.

Real DeepSeek V4 checkpoints ship their own tokenizer; the synthetic presets have none, and
clients can always send token ids instead of text.
"""

from __future__ import annotations

BOS, EOS = 0, 1
OFFSET = 2  # ids 0 and 1 are bos/eos in the V4 config


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < 256 + OFFSET:
            raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Ids outside the byte range (specials, the rest of the vocab) decode to nothing."""
        data = bytes(i - OFFSET for i in ids if OFFSET <= i < 256 + OFFSET)
        return data.decode("utf-8", errors="replace")
