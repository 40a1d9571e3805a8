"""The serving vLLM, as the pipeline reaches it."""

import dagster as dg
from pydantic import Field

from eagle3_assets.env_settings import EnvSettings, comma_list
from eagle3_assets.lib.serving.vllm_launcher import API_KEY_ENV
from eagle3_assets.lib.serving.vllm_probe import Labels, Probe, fetch_metrics, probe, smoke_chat


class VLLMServer(dg.ConfigurableResource, EnvSettings):
    """Attaches to running vLLM servers (one or several replicas); never starts one.

    Starting belongs to the launcher: a 22-minute load must not be tied to a Dagster run.
    """

    base_urls: list[str] = Field(["http://127.0.0.1:8000"], min_length=1)
    served_model_name: str = "target-v2"
    api_key: str | None = None
    probe_timeout_s: float = Field(2.0, gt=0)
    load_deadline_s: float = Field(1800.0, ge=0)

    env = {
        "base_urls": ("EAGLE3_VLLM_URLS", comma_list),
        "served_model_name": "EAGLE3_TARGET_MODEL",
        "load_deadline_s": "EAGLE3_VLLM_LOAD_DEADLINE_S",
    }
    secrets = {"api_key": API_KEY_ENV}

    def probe(self, base_url: str) -> Probe:
        return probe(base_url, timeout_s=self.probe_timeout_s, api_key=self.api_key)

    def metrics(self, base_url: str) -> dict[str, dict[Labels, float]]:
        return fetch_metrics(base_url, api_key=self.api_key)

    def smoke_chat(self, base_url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
        return smoke_chat(
            base_url, self.served_model_name, messages, max_tokens, api_key=self.api_key
        )


class ServingReplicas(dg.ConfigurableResource, EnvSettings):
    """The serving replicas Dagster may restart with a newly promoted drafter: the launcher's
    run dirs (`vllm_launcher start --run-dir`), one per replica, in rollout order. Empty:
    serving is started and restarted outside Dagster."""

    run_dirs: list[str] = []

    env = {"run_dirs": ("EAGLE3_SERVING_RUN_DIRS", comma_list)}
