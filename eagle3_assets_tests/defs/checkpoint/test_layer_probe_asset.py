"""drafter_checkpoint's layer probe against the session's real vLLM server: a warm start whose
nested ids are vLLM's default (as AQ-MedAI's) reads two ways; the served target answers the
held-out prompts, both readings' layers are extracted and scored, and an untrained drafter,
which predicts no better than chance, is refused naming both scores. The scores
are kept: a restart with the same revision and target measures nothing again."""

import re

import dagster as dg
import pytest

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.checkpoint.resources import DrafterHub
from eagle3_assets.lib.core.layer_ids import default_aux_layers
from eagle3_assets.localdev.hub import make_untrained_drafter, publish_to_hub_cache

pytestmark = pytest.mark.vllm
REPO = "local/untrained-eagle3"


def test_an_untrained_trap_drafter_is_refused_naming_both_scores(
    pipeline_env, test_world, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = tmp_path / "hub"
    nested = list(default_aux_layers(8))  # [2, 4, 5]: SGLang [3, 5, 6] or vLLM [2, 4, 5]
    untrained = make_untrained_drafter(
        test_world.target_v1, tmp_path / "untrained", 256, seed=1, nested_ids=nested
    )
    publish_to_hub_cache(untrained, hub, REPO)
    resources = resources_from_env(pipeline_env) | {
        "drafter_hub": DrafterHub(repo_id=REPO, revision="main", cache_dir=str(hub))
    }
    instance = dg.DagsterInstance.ephemeral()

    def refusal() -> tuple[str, list[str]]:
        result = dg.materialize(
            [drafter_checkpoint], resources=resources, instance=instance, raise_on_error=False
        )
        assert not result.success
        logs = [r.user_message for r in instance.all_logs(result.run_id)]
        return str(result.get_step_failure_events()[0].event_specific_data.error), logs

    message, logs = refusal()
    assert "neither scores clearly better: the warm start predicts no better than chance" in message
    assert "a uniform guess 5.5452)" in message  # ln(256), its draft vocab
    assert re.search(r"sglang reading \[3, 5, 6\]: stationarity \S+, step-0 loss ", message)
    assert re.search(r"vllm reading \[2, 4, 5\]: stationarity \S+, step-0 loss ", message)
    # the token count follows the server's greedy answers (278-280 seen on 2-core machines)
    assert re.search(r"; 5 of 5 samples supervised, \d+ tokens; chance loss 5\.5452\)", message)
    assert "Set EAGLE3_AUX_LAYER_IDS" in message
    assert any(m.startswith("layer probe: eagle_config ids [2, 4, 5] can be read") for m in logs)
    again, logs = refusal()  # a restart: the same scores, read back, not measured
    assert again == message
    assert any(m.startswith("layer probe: scores measured earlier") for m in logs)
    assert not any(m.startswith("layer probe: eagle_config ids") for m in logs)
