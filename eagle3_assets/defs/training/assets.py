"""The finetuned drafter: EAGLE-3 training on every extracted batch, through Pipes + torchrun."""

import hashlib
import json
import shlex
from pathlib import Path

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.lib.training.torchrun import torchrun_command
from eagle3_assets.resources import Storage, TargetModel, TrainingLauncher, TrainingRecipe


@dg.asset(
    deps=[
        drafter_checkpoint,
        dg.AssetDep("hidden_states", partition_mapping=dg.AllPartitionMapping()),
    ],
    group_name="training",
    kinds={"pytorch"},
    pool="gpu",
    # once every registered batch is extracted (acted on by drafter_automation)
    automation_condition=dg.AutomationCondition.eager(),
)
def eagle3_drafter(
    context: dg.AssetExecutionContext,
    training_launcher: TrainingLauncher,
    target: TargetModel,
    training: TrainingRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """The warm-start drafter finetuned on every extracted batch, exported for vLLM. The run
    directory is keyed by the data and the recipe, so a cancelled run resumes from its last
    checkpoint when materialized again, and new batches start a new run. Dagster launches
    node 0 (as a subprocess or a Kubernetes pod); other nodes join with the logged command."""
    batches = sorted(context.instance.get_materialized_partitions(dg.AssetKey("hidden_states")))
    batch_dirs = [
        str(storage.path("hidden_states", b))
        for b in batches
        if storage.path("hidden_states", b, "manifest.json").exists()
    ]
    if not batch_dirs:
        raise dg.Failure("no extracted hidden_states batch: materialize hidden_states first")
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
