"""The finetuned drafter: EAGLE-3 training on every extracted batch, through Pipes + torchrun."""

import hashlib
import json
import sys

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.resources import Storage, TargetModel, TrainingRecipe


@dg.asset(
    deps=[
        drafter_checkpoint,
        dg.AssetDep("hidden_states", partition_mapping=dg.AllPartitionMapping()),
    ],
    group_name="training",
    kinds={"pytorch"},
    pool="gpu",
)
def eagle3_drafter(
    context: dg.AssetExecutionContext,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    target: TargetModel,
    training: TrainingRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """The warm-start drafter finetuned on every extracted batch, exported for vLLM. The run
    directory is keyed by the data and the recipe, so a cancelled run resumes from its last
    checkpoint when materialized again, and new batches start a new run."""
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
    key = hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:12]
    out_dir = storage.path("drafter", "runs", key)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_file = out_dir / "run.json"
    run_file.write_text(json.dumps({**run, "out_dir": str(out_dir)}, indent=1))
    context.log.info(
        f"{len(batch_dirs)} batches, {training.nproc} rank(s), {training.steps} steps: {out_dir}"
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={training.nproc}",
        "-m",
        "eagle3_assets.training_entry",
        str(run_file),
    ]
    return pipes_subprocess_client.run(command=command, context=context).get_materialize_result()
