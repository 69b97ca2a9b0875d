import json

import pytest

from runtime.model.config import CSA, HCA, RANGES, SLIDING, ConfigError, from_dict, load_config
from runtime.synth.checkpoint import PRESETS, V4_FLASH, preset_config_dict


def test_v4_flash_derived_facts():
    c = from_dict(V4_FLASH)
    assert c.num_hidden_layers == 43 and len(c.compress_ratios) == 44
    assert c.layer_kinds[:2] == (SLIDING, SLIDING)
    assert len(c.csa_layers) == 21 and len(c.hca_layers) == 20
    assert c.layer_kind(2) == CSA and c.layer_kind(3) == HCA and c.layer_kind(42) == CSA
    assert c.mtp_kinds == (SLIDING,)
    assert c.hash_layers == (0, 1, 2)
    assert c.fp8_block == (128, 128)
    assert c.expert_dtype == "fp4"
    c.check_ranks(8)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_valid_configs(preset):
    c = from_dict(preset_config_dict(preset))
    assert c.num_nextn_predict_layers == 1
    assert c.csa_layers and c.hca_layers and c.sliding_layers


def _bad(**changes):
    raw = dict(V4_FLASH)
    for k, v in changes.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    return raw


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"norm_topk_prob": 1}, "norm_topk_prob"),
        ({"num_hidden_layers": 42}, "compress_ratios"),
        ({"compress_ratios": [0, 0]}, "compress_ratios"),
        ({"o_groups": 7}, "o_groups"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
         "quantization_config.weight_block_size"),
        ({"expert_dtype": "int3"}, "expert_dtype"),
        # values DeepSeek V4 (and transformers' DeepseekV4Config) cannot run as given
        ({"compress_ratios": [0, 0] + [4, 128] * 19 + [4, 64] + [4] + [0]}, "compress_ratios"),
        ({"rope_scaling": {"type": "linear", "factor": 4}}, "rope_scaling.type"),
        ({"rope_scaling": {"type": "yarn", "factor": 16}}, "rope_scaling.original_max_position_embeddings"),
    ],
)
def test_bad_config_names_file_and_field(tmp_path, changes, field):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_bad(**changes)))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(path) in str(e.value) and f"'{field}'" in str(e.value)


def test_experts_not_divisible_by_ranks():
    c = from_dict(V4_FLASH)
    with pytest.raises(ConfigError, match="n_routed_experts=256 is not divisible by ranks=3"):
        c.check_ranks(3)


def test_malformed_and_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("name", sorted(RANGES))
def test_every_range_admits_the_released_config_and_names_itself_when_left(name):
    lo, hi = RANGES[name]
    released = getattr(from_dict(V4_FLASH), name)
    assert lo <= released <= hi
    beyond = (lo / 2, hi * 2, float("nan")) if isinstance(released, float) else (lo - 1, hi + 1)
    for value in beyond:
        raw = dict(V4_FLASH, **{name: value})
        with pytest.raises(ConfigError, match=rf"'{name}' = .* is out of range; allowed "):
            from_dict(raw)


def test_huge_numbers_are_one_line_not_an_overflow():
    with pytest.raises(ConfigError, match="'rope_theta' .* too large for a float"):
        from_dict(dict(V4_FLASH, rope_theta=10**400))
    with pytest.raises(ConfigError, match="'compress_ratios' holds -1, out of range"):
        from_dict(dict(V4_FLASH, compress_ratios=[0] * 43 + [-1]))
