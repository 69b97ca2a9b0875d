"""Tokenizers (tokenizer.json via Hugging Face `tokenizers`, the byte fallback), streaming text
and stop strings, and the scheduler's queue time and cancellation over a fake engine."""

import asyncio
import json

import pytest
from engine_fakes import CountingEngine

from runtime.engine.sampling import Sampling
from runtime.model.config import load_config
from runtime.model.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    TokenizerError,
    load_tokenizer,
)
from runtime.serve.responses import StopMatcher
from runtime.serve.scheduler import Cancelled, QueueTimeout, Scheduler
from runtime.synth.tokenizer import train_tokenizer_json


def test_synth_writes_a_byte_level_bpe_with_the_presets_vocabulary(tiny_ckpt_ro):
    config = load_config(tiny_ckpt_ro)
    tok, warning = load_tokenizer(tiny_ckpt_ro, config.vocab_size)
    assert isinstance(tok, HFTokenizer) and warning is None
    assert tok._tok.get_vocab_size() == config.vocab_size
    assert (tok.bos_id, tok.eos_id) == (0, 1)  # as config.json's bos/eos ids
    assert [tok.special_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    text = "DeepSeek V4 serves the kernel cache: héllo ✓"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the kernel cache")) < len("the kernel cache")  # merges were learned


def test_training_is_deterministic_and_fills_a_large_vocabulary():
    assert train_tokenizer_json(512) == train_tokenizer_json(512)
    big = json.loads(train_tokenizer_json(32768))
    ids = sorted(big["model"]["vocab"].values())
    assert ids == list(range(32768))  # merges the corpus allows, then reserved ids


def test_no_tokenizer_json_falls_back_to_bytes_with_a_warning(tmp_path):
    tok, warning = load_tokenizer(tmp_path, 512)
    assert isinstance(tok, ByteTokenizer) and "no tokenizer.json" in warning
    assert tok.special_id(EOS_TOKEN) == 1 and tok.special_id(BOS_TOKEN) == 0


def test_tokenizer_whose_ids_pass_the_vocabulary_is_refused(tiny_ckpt_ro):
    with pytest.raises(TokenizerError, match="vocab_size is 300"):
        load_tokenizer(tiny_ckpt_ro, 300)


def test_incremental_decoding_never_splits_a_character(tiny_ckpt_ro):
    tok, _ = load_tokenizer(tiny_ckpt_ro, 512)
    text = "wörld ✓ 你好 🚀 done"
    for t in (tok, ByteTokenizer(512)):
        dec = IncrementalDecoder(t)
        pieces = [dec.push(i) for i in t.encode_plain(text)] + [dec.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(("chunks", "stops", "released", "hit"), [
    (["ab", "cS", "TOPx"], ["STOP"], "abc", True),
    (["ab", "cd"], ["zz"], "abcd", False),
    (["a", "S", "T", "x"], ["STOP"], "aSTx", False),
    (["hello"], [], "hello", False),
])
def test_stop_strings_end_the_text_before_them(chunks, stops, released, hit):
    m = StopMatcher(stops)
    out, stopped = "", False
    for c in chunks:
        piece, stopped = m.feed(c)
        out += piece
        if stopped:
            break
    if not stopped:
        out += m.flush()
    assert (out, stopped) == (released, hit)


# ---- the scheduler over a fake engine: one token per step ---------------------------------------


def _run(coro):
    return asyncio.run(coro)


def test_jobs_run_to_length_or_stop_token():
    async def main():
        s = Scheduler(CountingEngine(slots=1, base=100))
        a = s.submit([1], Sampling(max_tokens=3))
        b = s.submit([1], Sampling(max_tokens=5, stop_ids=frozenset({101})))
        got_a = [t async for t in a]
        got_b = [t async for t in b]
        s.close()
        return got_a, a.finish_reason, got_b, b.finish_reason

    assert _run(main()) == ([100, 101, 102], "length", [100, 101], "stop")


def test_a_cancelled_job_stops_within_one_step_and_frees_its_slot():
    async def main():
        engine = CountingEngine(slots=1, base=100, gated=True)
        s = Scheduler(engine)
        job = s.submit([1], Sampling(max_tokens=1000))
        it = job.__aiter__()
        engine.allow(1)
        await it.__anext__()
        at_cancel = engine.steps
        job.cancel()
        engine.allow(50)  # plenty of steps on offer: the worker must take at most one
        _ = [t async for t in it]
        nxt = s.submit([1], Sampling(max_tokens=1))
        await nxt.started()  # the slot is free again
        s.close()
        return engine.steps - at_cancel, job.finish_reason

    extra, reason = _run(main())
    assert extra <= 1 and reason == "cancelled"


def test_queue_time_is_bounded_and_a_queued_job_can_leave():
    async def main():
        engine = CountingEngine(slots=1, base=100, gated=True)  # the only slot is stuck
        s = Scheduler(engine, queue_timeout=0.2)
        busy = s.submit([1], Sampling(max_tokens=5))
        waits = s.submit([1], Sampling(max_tokens=1))
        leaves = s.submit([1], Sampling(max_tokens=1))
        leaves.cancel()
        with pytest.raises(Cancelled):
            await leaves.started()
        with pytest.raises(QueueTimeout) as e:
            await waits.started()
        assert s.queued == 0 and e.value.retry_after >= 1
        engine.allow(5)
        _ = [t async for t in busy]
        s.close()
        return engine.steps

    assert _run(main()) == 5  # neither queued job ever ran
