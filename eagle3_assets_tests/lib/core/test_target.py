"""The target's config is read in one place: its language model's fields, Kimi's included."""

import json

from eagle3_assets.lib.core.target import TargetShape, target_config

LLAMA = {"hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 8, "rms_norm_eps": 1e-5}
# Kimi-K2.5: the language model's fields nested in text_config
KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {"hidden_size": 7168, "vocab_size": 163840, "num_hidden_layers": 61},
}


def test_a_plain_config_from_its_folder_or_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert target_config(tmp_path) == target_config(tmp_path / "config.json") == LLAMA
    assert TargetShape.from_config(tmp_path) == TargetShape(64, 512, 8)
    assert TargetShape.from_fields(LLAMA) == TargetShape(64, 512, 8)


def test_a_multimodal_config_is_its_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI))
    assert target_config(tmp_path) == KIMI["text_config"]
    assert TargetShape.from_config(tmp_path) == TargetShape(7168, 163840, 61)
