"""TGI's --rope-scaling/--rope-factor as a config rewrite (bus/model_files.py), for every config shape served."""

import pytest

from llmbus.bus.model_files import rope_override, rope_positions, with_rope_override


@pytest.mark.parametrize("scaling, factor, expected", [
    (None, None, None),
    ("dynamic", None, ("dynamic", 1.0)),  # TGI: a kind alone scales by 1.0
    (None, 4.0, ("linear", 4.0)),  # a factor alone is linear
    ("dynamic", 2.0, ("dynamic", 2.0)),
])
def test_flags_pair_as_tgi_pairs_them(scaling, factor, expected):
    assert rope_override(scaling, factor) == expected


def test_transformers_5_config_keeps_its_base_and_partial_rotation():
    config = {"max_position_embeddings": 100, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "rope_theta": 5e5, "partial_rotary_factor": 0.5}}
    linear = with_rope_override(config, ("linear", 2.0))
    assert linear == {"max_position_embeddings": 200, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e5, "partial_rotary_factor": 0.5}}
    # dynamic NTK reads max_position_embeddings as the trained length: it stays
    assert with_rope_override(config, ("dynamic", 2.0))["max_position_embeddings"] == 100
    assert rope_positions(config, ("linear", 2.0)) == rope_positions(config, ("dynamic", 2.0)) == 200
    assert config["rope_parameters"]["rope_type"] == "llama3", "the given config is left as it was"


def test_transformers_4_config_gets_a_rope_scaling():
    config = {"max_position_embeddings": 64, "rope_theta": 1e4, "rope_scaling": None}
    assert with_rope_override(config, ("dynamic", 3.0)) == {
        "max_position_embeddings": 64, "rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}
    assert rope_positions(config, None) == 64 and rope_positions(config, ("dynamic", 3.0)) == 192


def test_gemma3_full_attention_layers_take_it_in_a_multimodal_config():
    text = {"max_position_embeddings": 1024, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    out = with_rope_override({"model_type": "gemma3", "text_config": text}, ("linear", 2.0))["text_config"]
    assert out["rope_parameters"] == {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert out["max_position_embeddings"] == 2048


def test_no_override_is_the_config_itself():
    config = {"max_position_embeddings": 8}
    assert with_rope_override(config, None) is config


@pytest.mark.parametrize("config, positions", [
    # dynamic NTK grows the base past the trained length it reads max_position_embeddings as: the factor's reach
    ({"max_position_embeddings": 24, "rope_scaling": {"type": "dynamic", "factor": 4.0}}, 96),
    # YaRN as Qwen's instructions add it (the original length left in max_position_embeddings) and as DeepSeek
    # writes it (max_position_embeddings already stretched)
    ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}}, 131072),
    ({"max_position_embeddings": 163840, "rope_parameters": {"rope_type": "yarn", "factor": 40,
                                                             "original_max_position_embeddings": 4096}}, 163840),
    # Llama 3.1's and linear scaling's configs say the stretched length themselves
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                          "original_max_position_embeddings": 8192}}, 131072),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 4096),
    ({"text_config": {"max_position_embeddings": 1000, "rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0}}}}, 2000),
])
def test_a_configs_own_scaling_reaches_as_the_workers_read_it(config, positions):
    """The launcher's limit is what the ranks embed (rotary.py and the fallback read the same rule)."""
    assert rope_positions(config, None) == positions
