"""What tools this project did not write read (issue 27): transformers' AutoConfig loads a
synthetic checkpoint as DeepseekV4Config with the layer kinds and compression rates the project
reads, AutoTokenizer loads its tokenizer with V4's bos/eos/pad and encodes as the service does;
the project reads either config form (V4's `compress_ratios` only, or named `layer_types`)."""

from __future__ import annotations

import json
import warnings

import pytest

from runtime.model.config import CSA, HCA, SLIDING, ConfigError, from_dict, load_config
from runtime.model.tokenizer import BOS_TOKEN, EOS_TOKEN, load_tokenizer
from runtime.synth.checkpoint import V4_FLASH, preset_config_dict
from runtime.synth.tokenizer import TOKENIZER_CONFIG_NAME, tokenizer_config, train_tokenizer_json

TEXTS = ["Hello world", f"{BOS_TOKEN}hi there{EOS_TOKEN}", "DeepSeek V4 ünïcode 🙂 <think>x</think>"]
PEER_KINDS = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}


def _preset_dir(tmp_path, preset: str):
    """A preset's config.json and tokenizer files, as `dsv4 synth` writes them (no weights)."""
    cfg = preset_config_dict(preset)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text(train_tokenizer_json(cfg["vocab_size"]))
    (tmp_path / TOKENIZER_CONFIG_NAME).write_text(json.dumps(tokenizer_config(cfg["max_position_embeddings"])))
    return tmp_path


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_transformers_loads_the_config_and_tokenizer_offline(tmp_path, preset, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _preset_dir(tmp_path, preset)
    ours = load_config(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer = AutoConfig.from_pretrained(model)
        tok = AutoTokenizer.from_pretrained(model)
    assert type(peer).__name__ == "DeepseekV4Config"
    assert [PEER_KINDS[t] for t in peer.layer_types] == list(ours.layer_kinds)
    for i, kind in enumerate(ours.layer_kinds):
        if kind != SLIDING:
            assert peer.compress_rates[next(k for k, v in PEER_KINDS.items() if v == kind)] == ours.compress_ratios[i]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS_TOKEN, EOS_TOKEN, EOS_TOKEN)
    mine, _ = load_tokenizer(model, ours.vocab_size)
    assert (tok.bos_token_id, tok.eos_token_id) == (mine.bos_id, mine.eos_id) == (0, 1)
    for text in TEXTS:
        assert tok(text)["input_ids"] == mine.encode(text), text
        assert tok.decode(mine.encode(text), skip_special_tokens=True) == mine.decode(mine.encode(text))


def test_the_synthesized_checkpoint_is_the_form_transformers_reads(tiny_ckpt_ro):
    raw = json.loads((tiny_ckpt_ro / "config.json").read_text())
    assert raw["compress_ratios"] == [0, 0, 4, 16, 4, 0]  # V4's own form, kept
    assert raw["layer_types"][3] == "heavily_compressed_attention"  # ratio 16: named, not guessed
    assert raw["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert (tiny_ckpt_ro / TOKENIZER_CONFIG_NAME).is_file()


def test_either_form_reads_as_the_same_layers():
    v4 = from_dict(V4_FLASH)  # the released config: compress_ratios only
    assert v4.layer_types == () and v4.layer_kinds[:4] == (SLIDING, SLIDING, CSA, HCA)
    named = {k: v for k, v in V4_FLASH.items() if k != "compress_ratios"}
    named.update(v4.transformers_fields())
    both = from_dict(named)
    assert both.layer_kinds == v4.layer_kinds and both.compress_ratios == v4.compress_ratios
    # a kind named explicitly holds even where the ratio rule would guess another
    odd = {**named, "compress_rates": {"compressed_sparse_attention": 16, "heavily_compressed_attention": 128}}
    assert from_dict(odd).layer_kinds[2] == CSA and from_dict(odd).compress_ratios[2] == 16


@pytest.mark.parametrize("change, says", [
    ({"layer_types": ["sliding_attention"]}, "'layer_types' has 1 entries"),
    ({"layer_types": "sliding"}, "'layer_types' must be a list"),
    ({"compress_rates": {"compressed_sparse_attention": 0}}, "'compress_rates' must map"),
    ({"compress_ratios": [0] * 44}, "disagrees with 'layer_types'"),
])
def test_a_bad_named_form_is_one_line_naming_the_field(change, says):
    named = {**V4_FLASH, **from_dict(V4_FLASH).transformers_fields(), **change}
    with pytest.raises(ConfigError, match=says):
        from_dict(named)
