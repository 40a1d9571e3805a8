"""The warm-start drafter, downloaded and proven to fit the target before anything uses it."""

import dagster as dg

from eagle3_assets.defs.checkpoint.resources import DrafterHub
from eagle3_assets.defs.serving.assets import vllm_server
from eagle3_assets.resources import Storage, TargetModel


@dg.asset(deps=[vllm_server], group_name="checkpoint", kinds={"huggingface", "safetensors"})
def drafter_checkpoint(
    context: dg.AssetExecutionContext,
    drafter_hub: DrafterHub,
    target: TargetModel,
    storage: Storage,
) -> dg.MaterializeResult:
    """The drafter to finetune: config and safetensors only (a pickle is never fetched), checked
    against the served target's shape, so a wrong download fails here and not hours later."""
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
        f"{list(info.aux_layer_ids_vllm)} (vLLM ids, from {info.aux_layer_ids_source})"
    )
    return dg.MaterializeResult(
        metadata={
            "repo_id": drafter_hub.repo_id,
            "revision": revision,
            "path": dg.MetadataValue.path(str(path)),
            "bytes": info.bytes_on_disk,
            "parameters": info.num_parameters,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            "draft_vocab_size": info.draft_vocab_size,
            "aux_layer_ids_vllm": str(list(info.aux_layer_ids_vllm)),
            "aux_layer_ids_sglang": str(list(info.aux_layer_ids_sglang)),
            "aux_layer_ids_source": str(info.aux_layer_ids_source),
            "layout": info.source_format,
            "tensors": dg.MetadataValue.md(
                "| tensor | dtype | shape |\n| --- | --- | --- |\n"
                + "\n".join(f"| {n} | {d} | {list(s)} |" for n, (d, s) in info.tensors.items())
            ),
        },
        data_version=dg.DataVersion(revision),
    )
