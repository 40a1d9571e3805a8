"""The warm-start drafter, downloaded and proven to fit the target before anything uses it."""

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from eagle3_assets.defs.checkpoint.resources import DrafterHub
from eagle3_assets.defs.evaluation.resources import EvaluationRecipe
from eagle3_assets.defs.generation.resources import GenerationRecipe
from eagle3_assets.defs.hidden_states.resources import HiddenStatesRecipe
from eagle3_assets.defs.serving.assets import vllm_server
from eagle3_assets.defs.serving.resources import VLLMServer
from eagle3_assets.lib.core.platform import Platform
from eagle3_assets.resources import Compute, Storage, TargetModel

if TYPE_CHECKING:  # imported where used: every multiprocess step re-imports this module
    from eagle3_assets.lib.checkpoint.layer_probe import ProbeScores
    from eagle3_assets.lib.core.layer_ids import Reading


@dg.asset(
    deps=[vllm_server],
    group_name="checkpoint",
    kinds={"huggingface", "safetensors"},
    output_required=False,  # unchanged since its latest materialization: nothing recorded
)
def drafter_checkpoint(
    context: dg.AssetExecutionContext,
    drafter_hub: DrafterHub,
    target: TargetModel,
    storage: Storage,
    vllm: VLLMServer,
    generation: GenerationRecipe,
    evaluation: EvaluationRecipe,
    hidden: HiddenStatesRecipe,
    compute: Compute,
) -> Iterator[dg.MaterializeResult]:
    """The drafter to finetune: config and safetensors only (a pickle is never fetched), checked
    against the served target's shape, so a wrong download fails here and not hours later.
    Its aux layer ids are settled and pinned in its config: EAGLE3_AUX_LAYER_IDS when set,
    else, when nested ids read two ways, the reading that scores clearly better on the served
    target's answers to a few held-out prompts (scored once per revision and target).

    Every serving start requests it (the `launch` run); when the resolved revision and the
    files are those of its latest materialization, it records nothing, so a server restart
    re-runs nothing downstream (eager automation reacts to every new materialization). In a
    run that also materializes one of its consumers it always records (a consumer in the
    same run is skipped when its dependency records nothing)."""
    from eagle3_assets.lib.checkpoint.drafter_checkpoint import download_drafter
    from eagle3_assets.lib.checkpoint.drafter_io import validate_drafter
    from eagle3_assets.lib.checkpoint.layer_probe import (
        LayerIdsUnclear,
        probe_key,
        settle_layer_ids,
    )

    path, revision = download_drafter(
        drafter_hub.repo_id,
        drafter_hub.revision,
        storage.path("drafter", "warm_start"),
        token=drafter_hub.token,
        cache_dir=drafter_hub.cache_dir,
        log=context.log.warning,
    )
    shape = target.shape()
    info = validate_drafter(path, shape)
    key = probe_key(revision, Path(target.path), target.revision)
    probe_dir = storage.path("drafter", "layer_probe", key)
    try:
        decision = settle_layer_ids(
            path,
            info.aux_layer_ids,
            shape,
            drafter_hub.aux_layer_ids,
            probe_dir / "scores.json",
            lambda readings: _measure(
                readings,
                path,
                probe_dir,
                drafter_hub,
                target,
                vllm,
                generation,
                evaluation,
                hidden,
                compute.platform,
                storage,
                context.log.info,
            ),
            log=context.log.info,
        )
    except LayerIdsUnclear as unclear:
        raise dg.Failure(str(unclear)) from None
    if decision is not None:
        info = validate_drafter(path, shape)  # the pinned config, as every reader now sees it
    context.log.info(
        f"{drafter_hub.repo_id}@{revision[:12]}: {info.num_parameters:,} parameters, aux layers "
        f"{list(info.aux_layer_ids.vllm)} (vLLM ids, from {info.aux_layer_ids.source})"
    )
    identity = {
        "repo_id": drafter_hub.repo_id,
        "revision": revision,
        "path": str(path),
        "bytes": info.bytes_on_disk,
    }
    latest = _latest_identity(context)
    consumers = context.job_def.asset_layer.asset_graph.get(context.asset_key).child_keys
    if latest is not None and latest[1] == identity and not consumers:
        context.log.info(
            f"unchanged: {drafter_hub.repo_id}@{revision[:12]} already materialized by run "
            f"{latest[0][:8]}; nothing recorded, so nothing downstream re-runs"
        )
        return
    yield dg.MaterializeResult(
        metadata={
            "repo_id": drafter_hub.repo_id,
            "revision": revision,
            "path": dg.MetadataValue.path(str(path)),
            "bytes": info.bytes_on_disk,
            "parameters": info.num_parameters,
            "hidden_size": info.config.hidden_size,
            "vocab_size": info.config.vocab_size,
            "draft_vocab_size": info.config.draft_vocab_size,
            "aux_layer_ids_vllm": dg.MetadataValue.json(list(info.aux_layer_ids.vllm)),
            "aux_layer_ids_sglang": dg.MetadataValue.json(list(info.aux_layer_ids.sglang)),
            "aux_layer_ids_source": str(info.aux_layer_ids.source),
            "layout": info.source_format,
            **({} if decision is None else decision.metadata()),
            "tensors": dg.MetadataValue.table(
                [
                    dg.TableRecord({"tensor": name, "dtype": dtype, "shape": str(list(shape))})
                    for name, (dtype, shape) in info.tensors.items()
                ],
                schema=dg.TableSchema(
                    columns=[dg.TableColumn(c, "string") for c in ("tensor", "dtype", "shape")]
                ),
            ),
        },
        data_version=dg.DataVersion(revision),
    )


def _latest_identity(context: dg.AssetExecutionContext) -> tuple[str, dict] | None:
    """(run id, repo, revision sha, path, bytes) of the latest materialization, from its metadata. A
    revision sha names its files (a commit), and the download just put exactly those in place
    and validated them, so the same four mean the same checkpoint in the same place."""
    event = context.instance.get_latest_materialization_event(context.asset_key)
    if event is None or event.asset_materialization is None:
        return None
    meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    return event.run_id, {k: meta.get(k) for k in ("repo_id", "revision", "path", "bytes")}


def _measure(
    readings: "dict[Reading, tuple[int, ...]]",
    drafter_dir: Path,
    probe_dir: Path,
    drafter_hub: DrafterHub,
    target: TargetModel,
    vllm: VLLMServer,
    generation: GenerationRecipe,
    evaluation: EvaluationRecipe,
    hidden: HiddenStatesRecipe,
    platform: Platform,
    storage: Storage,
    log,
) -> "ProbeScores":
    """The layer probe's inputs from the resources: the held-out prompts, the served target,
    the generation recipe's rendering, the configured extraction backend."""
    from eagle3_assets.lib.checkpoint.layer_probe import ProbeSamples, measure_readings
    from eagle3_assets.lib.core.hub_files import local_file
    from eagle3_assets.lib.generation.conversations import load_conversations
    from eagle3_assets.lib.hidden_states.backends import open_backend
    from eagle3_assets.lib.hidden_states.extract import ExtractionSettings
    from eagle3_assets.lib.hidden_states.shard_format import ShardFormat

    heldout = local_file(evaluation.heldout_prompts, evaluation.cache_dir, evaluation.token)
    samples = ProbeSamples(
        conversations=load_conversations(heldout)[: drafter_hub.probe_prompts],
        base_urls=vllm.base_urls,
        served_model=vllm.served_model_name,
        api_key=vllm.api_key,
        generation=generation.config(),
        max_tokens=drafter_hub.probe_max_tokens,
        work_dir=probe_dir,
    )
    settings = hidden.extraction()
    return measure_readings(
        samples,
        drafter_dir,
        Path(target.path),
        target.tokenizer(),
        lambda layer_ids: open_backend(
            hidden,
            platform,
            target.path,
            target.trust_remote_code,
            layer_ids,
            target.shape().hidden_size,
            storage.path("vllm-extraction"),
            log,
        ),
        # bf16 states: a few samples, read at full precision
        ExtractionSettings(
            ShardFormat("bf16", "bf16"),
            batch_tokens=settings.batch_tokens,
            max_length=settings.max_length,
        ),
        {"target": target.path, "revision": target.revision, "backend": hidden.backend},
        readings,
        log,
    )
