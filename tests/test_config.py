"""config.json parsing: the published configs, both rope spellings, and clear refusals."""

import json

import pytest

from tinyoss.config import ConfigError, ModelConfig
from tinyoss.model.presets import GENERATION_CONFIG, preset_config


def test_published_20b_and_120b():
    c = ModelConfig.from_dict(preset_config("gpt-oss-20b"), GENERATION_CONFIG)
    assert (c.num_hidden_layers, c.num_local_experts, c.num_experts_per_tok) == (24, 32, 4)
    assert (c.q_size, c.kv_size, c.vocab_size) == (4096, 512, 201088)
    assert c.window(0) == 128 and c.window(1) == 0 and c.window(22) == 128 and c.window(23) == 0
    assert c.rope.yarn and c.rope.factor == 32 and c.rope.theta == 150000 and not c.rope.truncate
    assert c.eos_token_ids == (200002, 199999, 200012) and c.bos_token_id == 199998
    c120 = ModelConfig.from_dict(preset_config("openai/gpt-oss-120b"))
    assert (c120.num_hidden_layers, c120.num_local_experts) == (36, 128)
    assert c120.eos_token_ids == (200002,)


def test_rope_parameters_spelling_and_default_layer_types():
    d = preset_config("tiny")
    d["rope_parameters"] = d.pop("rope_scaling") | {"rope_theta": 10000.0}
    del d["layer_types"]
    c = ModelConfig.from_dict(d)
    assert c.rope.theta == 10000.0 and c.rope.yarn
    assert c.layer_types == ("sliding_attention", "full_attention") * 2


def test_from_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny")))
    assert ModelConfig.from_folder(tmp_path).hidden_size == 128


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "llama"}, "model_type is 'llama'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method is 'awq'"),
        ({"quantization_config": None}, "quant_method is None"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "exceeds num_local_experts"),
        ({"hidden_size": 100}, "hidden_size \\(100\\) must be a multiple of 32"),
        ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries for 4 layers"),
        (
            {"layer_types": ["sliding_attention", "local", "full_attention", "full_attention"]},
            "layer_types holds \\['local'\\]",
        ),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope_type 'longrope' is not supported"),
        ({"head_dim": 63}, "head_dim \\(63\\) must be even"),
    ],
)
def test_refusals_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(preset_config("tiny") | change)


def test_missing_required_field():
    d = preset_config("tiny")
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="missing required field\\(s\\) hidden_size"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("name,value,rule", [
    ("tensor_parallel_size", "2", "an int"), ("tensor_parallel_size", None, "an int"),
    ("tensor_parallel_size", 2.0, "an int"), ("tensor_parallel_size", True, "an int"),
    ("max_num_seqs", "8", "an int"), ("gpu_memory_utilization", "0.5", "a number"),
    ("enable_expert_parallel", "yes", "True or False"), ("enforce_eager", 1, "True or False"),
])
def test_engine_options_of_the_wrong_type_are_named(name, value, rule):
    """Found by a tensor-parallel user trial: LLM(tensor_parallel_size="2") failed on a
    comparison of str and int deep inside, 2.0 inside the worker start, "yes" ran as True."""
    from tinyoss.config import EngineConfig

    with pytest.raises(ValueError, match=f"invalid {name}: .* \\(must be {rule}\\)"):
        EngineConfig(**{name: value})
    EngineConfig(gpu_memory_utilization=1, max_model_len=None, decode_step_budget_ms=5)
    import numpy as np

    EngineConfig(max_num_seqs=np.int64(8), gpu_memory_utilization=np.float32(0.5))
