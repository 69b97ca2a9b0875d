"""The tokenizer.json `dsv4 synth` writes: a byte-level BPE trained at synth time, offline.

Trained with Hugging Face `tokenizers` (the library real V4 checkpoints are read with) on a
fixed corpus shipped in the package (`data/tokenizer_corpus.txt`: the project's own docs,
frozen so the result never changes under a docs edit). Training is deterministic: same
vocabulary size, same bytes. Ids 0.. are the V4 specials (bos 0 and eos 1 as in config.json),
then the 256 byte symbols, then merges; when the corpus runs out of merges before the preset's
vocabulary is full, the rest are reserved tokens no text encodes to, as a real checkpoint's
unused ids are, so the tokenizer's vocabulary equals the model's.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from importlib import resources

from runtime.model.tokenizer import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS

TOKENIZER_CONFIG_NAME = "tokenizer_config.json"

CORPUS = "data/tokenizer_corpus.txt"


@contextlib.contextmanager
def _no_parallelism() -> Iterator[None]:
    # A process that used the library's thread pool and then forks (the crash trials' fork
    # server does) gets a warning per child; the corpus is small, one thread is as fast.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def corpus_lines() -> list[str]:
    return resources.files("runtime.synth").joinpath(CORPUS).read_text(encoding="utf-8").splitlines()


def train_tokenizer_json(vocab_size: int) -> str:
    """The text of a tokenizer.json with exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is below the {floor} ids of a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with _no_parallelism():
        tok.train_from_iterator(corpus_lines(), trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<reserved_{i}>"] = i  # ASCII: the byte-level decoder maps it to itself
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json beside tokenizer.json, as a V4 repository ships one: what loaders
    (transformers' AutoTokenizer, the benchmark clients, vLLM) read for bos, eos and pad. It
    names no chat template: V4's chat encoding is its own (runtime.serve.chat_template). The
    tokenizer.json itself decides what encoding adds (nothing here overrides it)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
