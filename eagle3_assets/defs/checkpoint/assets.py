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
        f"{list(info.aux_layer_ids.vllm)} (vLLM ids, from {info.aux_layer_ids.source})"
    )
    return dg.MaterializeResult(
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
