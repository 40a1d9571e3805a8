"""Readiness: watch the server come up, record each change, launch the pipeline once per
server start."""

import hashlib
import json
import time

import dagster as dg

from eagle3_assets.defs.serving.resources import VLLMServer
from eagle3_assets.lib.serving.vllm_probe import Readiness, ServerState, advance, worth_recording
from eagle3_assets.partitions import next_batch, sample_batches

# What starts the moment the server is ready, in ONE run: the drafter download and the next
# generation batch run side by side under the multiprocess executor.
launch_job = dg.define_asset_job(
    "launch",
    selection=dg.AssetSelection.assets("drafter_checkpoint", "synthetic_generations"),
    partitions_def=sample_batches,
    description="Started once per server start: the checkpoint download beside the next batch.",
)


@dg.sensor(
    job=launch_job,
    minimum_interval_seconds=10,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="One cheap probe per replica per tick; observations on change; one launch run "
    "per server start.",
)
def vllm_readiness_sensor(context: dg.SensorEvaluationContext, vllm: VLLMServer):
    cursor = json.loads(context.cursor) if context.cursor else {}
    previous = {url: Readiness.from_json(data) for url, data in cursor.get("servers", {}).items()}
    now = time.time()
    current: dict[str, Readiness] = {}
    observations = []
    for url in vllm.base_urls:
        before = previous.get(url)
        after = advance(
            before or Readiness(),
            vllm.probe(url),
            now,
            vllm.served_model_name,
            vllm.load_deadline_s,
        )
        current[url] = after
        if worth_recording(before, after):
            observations.append(_observation(url, after, vllm.served_model_name, now))
            context.log.info(f"{url}: {after.state.value}: {after.detail}")
        if after.overdue and not (before and before.overdue):
            context.log.warning(
                f"{url} still not ready {now - after.loading_since:.0f}s after first seen "
                f"(deadline {vllm.load_deadline_s:.0f}s): check the server log"
            )

    run_requests, partition_requests = [], []
    launched = cursor.get("launched")
    if all(r.state is ServerState.READY for r in current.values()):
        instances = sorted(r.instance_id or "" for r in current.values())
        run_key = "launch-" + hashlib.sha256("|".join(instances).encode()).hexdigest()[:16]
        if run_key != launched:
            launched = run_key
            batch, partition_requests = next_batch(context.instance)
            run_requests.append(_launch_request(batch, run_key, instances))
    return dg.SensorResult(
        run_requests=run_requests,
        dynamic_partitions_requests=partition_requests,
        asset_events=observations,
        cursor=json.dumps(
            {"servers": {u: r.to_json() for u, r in current.items()}, "launched": launched}
        ),
    )


def _launch_request(batch: str | None, run_key: str, server_instances: list[str]) -> dg.RunRequest:
    """The next batch beside the download; the download alone once every batch is done."""
    tags = {"eagle3/server_instances": ",".join(server_instances)}
    if batch is None:
        selection = [dg.AssetKey("drafter_checkpoint")]
        return dg.RunRequest(run_key=run_key, asset_selection=selection, tags=tags)
    return dg.RunRequest(run_key=run_key, partition_key=batch, tags=tags)


def _observation(url: str, readiness: Readiness, model: str, now: float) -> dg.AssetObservation:
    metadata = {
        "state": readiness.state.value,
        "base_url": url,
        "detail": readiness.detail,
        "expected_model": model,
        "overdue": readiness.overdue,
    }
    if readiness.loading_since is not None:
        metadata["loading_for_s"] = round(now - readiness.loading_since, 1)
    if readiness.state is ServerState.READY:
        metadata |= {
            "max_model_len": readiness.max_model_len,
            "vllm_version": readiness.version or "unknown",
            "instance_id": readiness.instance_id,
            "drafting": readiness.drafting,
        }
        if readiness.acceptance_length is not None:  # from its /metrics: the drafter works
            metadata["mean_acceptance_length"] = round(readiness.acceptance_length, 3)
    return dg.AssetObservation(asset_key="vllm_server", metadata=metadata)


def server_ready(instance: dg.DagsterInstance) -> bool:
    """Whether the readiness sensor last recorded the server ready: a database read, no probe."""
    records = instance.fetch_observations(dg.AssetKey("vllm_server"), limit=1).records
    return bool(records) and records[0].asset_observation.metadata["state"].value == "ready"
