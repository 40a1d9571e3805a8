"""The warm-start drafter, downloaded and proven to fit the target before anything uses it."""

from collections.abc import Iterator

import dagster as dg

from eagle3_assets.defs.checkpoint.resources import DrafterHub
from eagle3_assets.defs.serving.assets import vllm_server
from eagle3_assets.resources import Storage, TargetModel


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
) -> Iterator[dg.MaterializeResult]:
    """The drafter to finetune: config and safetensors only (a pickle is never fetched), checked
    against the served target's shape, so a wrong download fails here and not hours later.

    Every serving start requests it (the `launch` run); when the resolved revision and the
    files are those of its latest materialization, it records nothing, so a server restart
    re-runs nothing downstream (eager automation reacts to every new materialization). In a
    run that also materializes one of its consumers it always records (a consumer in the
    same run is skipped when its dependency records nothing)."""
    from eagle3_assets.lib.checkpoint.drafter_checkpoint import download_drafter
    from eagle3_assets.lib.checkpoint.drafter_io import validate_drafter

    path, revision = download_drafter(
        drafter_hub.repo_id,
        drafter_hub.revision,
        storage.path("drafter", "warm_start"),
        token=drafter_hub.token,
        cache_dir=drafter_hub.cache_dir,
        log=context.log.warning,
    )
    info = validate_drafter(path, target.shape())
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
