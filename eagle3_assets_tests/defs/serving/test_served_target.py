import dagster as dg
import pytest

from eagle3_assets.defs.serving.assets import SMOKE_PROMPT, served_target
from eagle3_assets.defs.serving.resources import VLLMServer

pytestmark = pytest.mark.vllm


def test_served_target_generates(vllm_target):
    vllm = VLLMServer(base_urls=[vllm_target.base_url], served_model_name="target-v2")
    result = dg.materialize([served_target], resources={"vllm": vllm})
    (event,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["model"] == "target-v2" and meta["vllm_version"] == "0.32.0"
    assert meta["max_model_len"] == 1024 and meta["replicas"] == 1
    # the greedy reply's own length (temperature 0: the same reply when asked again)
    again = vllm.smoke_chat(vllm_target.base_url, SMOKE_PROMPT, max_tokens=32)
    assert meta["smoke_completion_tokens"] == again["completion_tokens"]


def test_served_target_fails_on_the_wrong_model(vllm_target):
    vllm = VLLMServer(base_urls=[vllm_target.base_url], served_model_name="kimi-k2.5")
    result = dg.materialize([served_target], resources={"vllm": vllm}, raise_on_error=False)
    assert not result.success
    message = str(result.get_step_failure_events()[0].event_specific_data.error)
    assert "does not serve 'kimi-k2.5'" in message and "target-v2" in message


def test_metrics_count_the_smoke_request(vllm_target):
    vllm = VLLMServer(base_urls=[vllm_target.base_url], served_model_name="target-v2")
    before = vllm.metrics(vllm_target.base_url)
    vllm.smoke_chat(vllm_target.base_url, [{"role": "user", "content": "Hi"}], max_tokens=4)
    after = vllm.metrics(vllm_target.base_url)
    finished = "vllm:request_success_total"
    assert sum(after[finished].values()) - sum(before.get(finished, {}).values()) == 1
    assert after["vllm:generation_tokens_total"] and after["process_start_time_seconds"]
