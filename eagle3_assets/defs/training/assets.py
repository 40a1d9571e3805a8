"""The finetuned drafter: EAGLE-3 training on every extracted batch, through Pipes + torchrun."""

import hashlib
import json
import shlex
from pathlib import Path

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.hidden_states.assets import CHECKS, FIXES
from eagle3_assets.defs.training.resources import TrainingLauncher, TrainingRecipe
from eagle3_assets.lib.hidden_states.batch_selection import select_batches
from eagle3_assets.lib.training.torchrun import torchrun_command
from eagle3_assets.partitions import eager_on_checked_inputs, latest_check_statuses
from eagle3_assets.resources import Storage, TargetModel


@dg.asset(
    deps=[
        drafter_checkpoint,
        dg.AssetDep("hidden_states", partition_mapping=dg.AllPartitionMapping()),
    ],
    group_name="training",
    kinds={"pytorch"},
    pool="gpu",
    # once every registered batch is extracted and none failed its checks (drafter_automation)
    automation_condition=eager_on_checked_inputs(),
)
def eagle3_drafter(
    context: dg.AssetExecutionContext,
    training_launcher: TrainingLauncher,
    target: TargetModel,
    training: TrainingRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """The warm-start drafter finetuned on every extracted batch whose checks passed, exported
    for vLLM; a batch whose latest check evaluation failed (or that was never checked) is left
    out and named. The run directory is keyed by the data and the recipe, so a cancelled run
    resumes from its last checkpoint when materialized again, and new batches start a new run.
    Dagster launches node 0 (as a subprocess or a Kubernetes pod); other nodes join with the
    logged command."""
    instance = context.instance
    materialized = sorted(instance.get_materialized_partitions(dg.AssetKey("hidden_states")))
    statuses = latest_check_statuses(instance, "hidden_states", CHECKS, materialized)
    manifests = [storage.path("hidden_states", b, "manifest.json") for b in materialized]
    on_disk = [b for b, m in zip(materialized, manifests, strict=True) if m.exists()]
    selection = select_batches(statuses, on_disk)
    left_out = [e.message("hidden_states", FIXES) for e in selection.excluded]
    for message in left_out:
        context.log.warning(message)
    if not selection.usable:
        raise dg.Failure(
            "no hidden_states batch passed its checks: materialize hidden_states"
            + (f"; {len(left_out)} left out:\n" + "\n".join(left_out) if left_out else " first"),
            metadata={"excluded_batches": "\n".join(left_out) or "none"},
        )
    context.add_asset_metadata(
        {
            "batches": ", ".join(selection.usable),
            "excluded_batches": "\n".join(left_out) or "none",
        }
    )
    batch_dirs = [str(storage.path("hidden_states", b)) for b in selection.usable]
    run = {
        "batch_dirs": batch_dirs,
        "warm_start": str(storage.path("drafter", "warm_start")),
        "target": target.path,
        **training.run_settings(),
    }
    # the world size too: a checkpoint holds each rank's data position, for that many ranks
    keyed = {**run, "world_size": training.nproc * training.nnodes}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    out_dir = storage.path("drafter", "runs", key)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_file = out_dir / "run.json"
    run_file.write_text(json.dumps({**run, "out_dir": str(out_dir)}, indent=1))
    context.log.info(
        f"{len(batch_dirs)} batches, {training.nnodes} node(s) x {training.nproc} rank(s), "
        f"{training.steps} steps: {out_dir}"
    )

    def command(node_rank: int) -> list[str]:
        entry = ["-m", "eagle3_assets.training_entry", str(run_file)]
        return torchrun_command(
            entry, training.nproc, training.nnodes, training.rdzv_endpoint, node_rank
        )

    if training.nnodes > 1:
        context.log.info(
            f"waiting for nodes 1..{training.nnodes - 1} at {training.rdzv_endpoint}: node k "
            "runs, with the data volume at the same path and --node-rank=k, "
            f"{shlex.join(command(1))}"
        )
    return training_launcher.run(
        context, command(0), gpus=training.nproc, data_root=str(Path(storage.root).resolve())
    ).get_materialize_result()
