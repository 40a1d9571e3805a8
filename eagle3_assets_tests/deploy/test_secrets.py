"""Secrets never reach what Dagster stores or shows: a real launch run (the drafter download
with HF_TOKEN set, a generation batch against a server that demands the vLLM API key) runs
as deployed, then every byte the instance wrote (event logs, run records, captured compute
logs) and what the web UI serves (run logs, asset metadata, resource config) is searched for
the secret values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
from dagster._serdes import serialize_value

from eagle3_assets.lib.core.hub_files import HF_TOKEN_ENV
from eagle3_assets.lib.serving.vllm_launcher import API_KEY_ENV
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_env
from eagle3_assets_tests.conftest import REPO, free_port
from eagle3_assets_tests.openai_stub import OpenAIStub
from eagle3_assets_tests.webserver import running_webserver

API_KEY = "sk-sentinel-vllm-3f9c1d2e7a"
HF_TOKEN = "hf_sentinelToken8b41c0aa"
DAGSTER = Path(sys.executable).parent / "dagster"

UI_QUERY = """
query UI($runId: ID!, $repo: RepositorySelector!) {
  logsForRun(runId: $runId) { ... on EventConnection { events {
    __typename ... on MessageEvent { message }
    ... on MaterializationEvent { metadataEntries { label description
      ... on TextMetadataEntry { text } ... on JsonMetadataEntry { jsonString }
      ... on PathMetadataEntry { path } ... on MarkdownMetadataEntry { mdStr } } }
  } } }
  runOrError(runId: $runId) { ... on Run { runConfigYaml tags { key value } } }
  allTopLevelResourceDetailsOrError(repositorySelector: $repo) { ... on ResourceDetailsList {
    results { name configuredValues { key value type } }
  } }
}
"""


def files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_api_key_and_hf_token_never_stored_or_shown(
    test_world, test_hub, dagster_home: Path, tmp_path: Path
) -> None:
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("sample_batches", ["batch-00000"])
    with OpenAIStub(api_key=API_KEY) as stub:
        env = {
            **os.environ,
            **miniature_env(
                test_world, test_hub, stub.base_url, tmp_path / "data", SERVED_TARGET_NAME
            ),
            API_KEY_ENV: API_KEY,
            HF_TOKEN_ENV: HF_TOKEN,
            "DAGSTER_HOME": str(dagster_home),
        }
        launch = subprocess.run(
            [str(DAGSTER), "job", "execute", "-m", "eagle3_assets.definitions", "-a", "defs",
             "-j", "launch", "--tags", json.dumps({"dagster/partition": "batch-00000"})],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    assert stub.answered == 16  # every request carried the key (the stub answers 401 without)
    warm_start = tmp_path / "data" / "drafter" / "warm_start"  # the hub repo holds a pickle too
    assert sorted(p.name for p in warm_start.iterdir()) == ["config.json", "model.safetensors"]

    with dg.DagsterInstance.get() as instance:
        (run,) = instance.get_runs()
        assert run.status == dg.DagsterRunStatus.SUCCESS
        records = instance.all_logs(run.run_id)
        materialized = {
            r.dagster_event.asset_key.to_user_string()
            for r in records
            if r.dagster_event and r.dagster_event.is_step_materialization
        }
        assert materialized == {"drafter_checkpoint", "synthetic_generations"}
        stored = serialize_value([*records, run])
    # The search can see what it must not find: the run's own values are there.
    assert "batch-00000: 16 prompts" in stored and str(tmp_path / "data") in stored
    assert any(p.endswith(".out") or p.endswith(".err") for p in map(str, dagster_home.rglob("*")))
    for secret in (API_KEY, HF_TOKEN):
        assert secret not in stored
        assert files_containing(dagster_home, secret.encode()) == []  # dbs, compute logs
        assert secret not in launch.stdout + launch.stderr

    ui_env = {k: v for k, v in env.items() if k != "DAGSTER_HOME"}
    with running_webserver(dagster_home, ui_env, free_port(), tmp_path / "ui.log") as server:
        repo = {"repositoryLocationName": "eagle3_assets", "repositoryName": "__repository__"}
        shown = server.graphql(UI_QUERY, {"runId": run.run_id, "repo": repo})
    text = json.dumps(shown)
    assert "batch-00000: 16 prompts" in text
    resources = {
        r["name"]: {v["key"]: (v["type"], v["value"]) for v in r["configuredValues"]}
        for r in shown["allTopLevelResourceDetailsOrError"]["results"]
    }
    assert resources["vllm"]["api_key"] == ("ENV_VAR", API_KEY_ENV)  # the name, not the value
    assert resources["drafter_hub"]["token"] == ("ENV_VAR", HF_TOKEN_ENV)
    for secret in (API_KEY, HF_TOKEN):
        assert secret not in text
        assert secret not in (tmp_path / "ui.log").read_text()
