"""The finetuned drafter: EAGLE-3 training on every usable batch, through Pipes + torchrun.

The deployment chooses how the hidden states reach training (EAGLE3_HIDDEN_STATES_MODE):
stored, from every extracted batch's shards (the drafter depends on hidden_states); or
streamed, extracted while training from every batch of generations (it depends on
synthetic_generations directly, and nothing grows on disk but a bounded spool)."""

import dataclasses
import hashlib
import json
import shlex
import sys
from pathlib import Path

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.generation.assets import ONE_ROW_PER_PROMPT, RESPONSE_QUALITY
from eagle3_assets.defs.generation.resources import GenerationRecipe
from eagle3_assets.defs.hidden_states.assets import CHECKS, FIXES, batch_sequences
from eagle3_assets.defs.hidden_states.resources import HiddenStatesRecipe
from eagle3_assets.defs.training.resources import TrainingLauncher, TrainingRecipe
from eagle3_assets.lib.evaluation.promotion import Registry, Version
from eagle3_assets.lib.hidden_states.batch_selection import BatchSelection, select_batches
from eagle3_assets.lib.training.torchrun import torchrun_command
from eagle3_assets.partitions import eager_on_checked_inputs, latest_check_statuses
from eagle3_assets.resources import Compute, Storage, TargetModel

# per mode: the asset whose every batch the drafter reads, its blocking checks, and what to
# fix when one fails
INPUTS = {
    "stored": ("hidden_states", CHECKS, FIXES),
    "streamed": ("synthetic_generations", (ONE_ROW_PER_PROMPT, RESPONSE_QUALITY), {}),
}


def batch_file(mode: str, storage: Storage, batch: str) -> Path:
    """The file a batch of the mode's input must have on the volume."""
    if mode == "stored":
        return storage.path("hidden_states", batch, "manifest.json")
    from eagle3_assets.lib.generation.store import FINAL_NAME  # pyarrow: imported where used

    return storage.path("generations", batch, FINAL_NAME)


def usable_batches(
    instance: dg.DagsterInstance, mode: str, storage: Storage
) -> tuple[BatchSelection, list[str]]:
    """The batches of the mode's input whose latest checks passed and whose files are there,
    and a message for each left out."""
    asset, checks, fixes = INPUTS[mode]
    materialized = sorted(instance.get_materialized_partitions(dg.AssetKey(asset)))
    statuses = latest_check_statuses(instance, asset, checks, materialized)
    on_disk = [b for b in materialized if batch_file(mode, storage, b).exists()]
    selection = select_batches(statuses, on_disk)
    return selection, [e.message(asset, fixes) for e in selection.excluded]


def streamed_run(
    context: dg.AssetExecutionContext,
    batches: list[str],
    target: TargetModel,
    generation: GenerationRecipe,
    hidden: HiddenStatesRecipe,
    storage: Storage,
) -> tuple[dict, str]:
    """The run's `stream` spec, and the digest of what it streams (for the run's key): every
    batch's sequences, tokenized once here (a template mismatch fails before any work), and
    the layers the warm start reads; a window smaller than one sample fails here too."""
    from eagle3_assets.lib.hidden_states.backends import drafter_layers
    from eagle3_assets.lib.hidden_states.streaming import StreamSpec, window_error, write_sequences

    tokenizer = target.tokenizer()  # once for every batch
    sequences = {
        b: batch_sequences(b, target, generation, hidden, storage, tokenizer)[1] for b in batches
    }
    shape = target.shape()
    try:
        layers = drafter_layers(storage.path("drafter", "warm_start"), shape.num_hidden_layers)
    except FileNotFoundError as missing:
        raise dg.Failure(str(missing)) from None
    every = [s for batch in sequences.values() for s in batch]
    if problem := window_error(hidden, every, shape.hidden_size, len(layers.aux)):
        raise dg.Failure(problem)
    digest = hashlib.sha256()
    for sequence in every:
        digest.update(sequence.sample_id.encode() + sequence.input_ids.tobytes())
    stream_dir = storage.path("drafter", "streams", digest.hexdigest()[:12])
    write_sequences(stream_dir / "sequences.safetensors", sequences)
    spec = StreamSpec(
        sequences=str(stream_dir / "sequences.safetensors"),
        spool="",  # in the run's own folder, set once the run is keyed
        settings=hidden.model_dump(),  # the recipe is a HiddenStatesSettings
        layers={"aux": list(layers.aux), "final": layers.final, "source": layers.source},
        hidden_size=shape.hidden_size,
        target=target.path,
        trust_remote_code=target.trust_remote_code,
        server_dir=str(storage.path("vllm-extraction")),
    )
    context.log.info(
        f"streaming {len(every)} samples ({sum(len(s) for s in every):,} tokens) via "
        f"{hidden.backend}: layers {list(layers.aux)} + final {layers.final} (vLLM ids, from "
        f"{layers.source}), {hidden.format}, window {hidden.stream_window_mb:g} MB"
    )
    return dataclasses.asdict(spec), digest.hexdigest()


def training_data(
    usable: list[str], promoted: Version | None, share: float, storage: Storage
) -> tuple[list[str], list[str]]:
    """The batches new to the run and, by id, the samples it leaves out. Before any
    promotion: every usable batch, whole. After one: the run warm-starts from the promoted
    drafter, so it needs batches new since it, and of the batches it learnt only the replay
    share is read again."""
    import pyarrow.parquet as pq

    from eagle3_assets.lib.generation.store import FINAL_NAME
    from eagle3_assets.lib.training.replay import replay_exclusions

    if promoted is None:
        return usable, []
    learnt = set(promoted.lineage["batches"])
    new = [b for b in usable if b not in learnt]
    if not new:
        raise dg.Failure(
            f"no usable batch is new since {promoted.name}, which learnt "
            f"{', '.join(sorted(learnt))}: drop new prompt files in EAGLE3_INBOX (or grow the "
            "pool) and generate their batches first"
        )
    ids = [  # the ids hidden-state samples carry: the generation's, per prompt and recipe
        sample_id
        for batch in usable
        if batch in learnt
        for sample_id in pq.read_table(
            storage.path("generations", batch, FINAL_NAME), columns=["sample_id"]
        )
        .column("sample_id")
        .to_pylist()
    ]
    return new, replay_exclusions(ids, share)


# where a run computes and how it writes the drafter out: its checkpoints (safetensors) resume
# on either platform, and a finished run exports again in the dtype asked for
UNKEYED = ("platform", "export_dtype")

DESCRIPTIONS = {
    "stored": " Hidden states stored: it reads the shards of every extracted batch.",
    "streamed": " Hidden states streamed: extracted from every batch of generations while it "
    "trains, at most EAGLE3_STREAM_WINDOW_MB on disk.",
}


DRAFTER = """The warm-start drafter finetuned on every batch whose checks passed, exported for
vLLM; a batch whose latest check evaluation failed (or that was never checked) is left out and
named. After a promotion it warm-starts from the promoted drafter instead, on the batches new
since it plus a replay share (EAGLE3_REPLAY_SHARE, by sample id) of those it learnt. The run
directory is keyed by the data and the recipe, so a cancelled or killed run resumes from its
last checkpoint when materialized again, and new batches start a new run. Dagster launches
node 0 (as a subprocess or a Kubernetes pod); other nodes join with the logged command."""


def build_eagle3_drafter(mode: str) -> dg.AssetsDefinition:
    """The drafter asset for a deployment's mode, `stored` or `streamed`."""
    asset = INPUTS[mode][0]

    @dg.asset(
        name="eagle3_drafter",
        deps=[drafter_checkpoint, dg.AssetDep(asset, partition_mapping=dg.AllPartitionMapping())],
        group_name="training",
        kinds={"pytorch"},
        pool="gpu",
        # once every registered batch is ready and none failed its checks (drafter_automation)
        automation_condition=eager_on_checked_inputs(),
        description=DRAFTER + DESCRIPTIONS[mode],
    )
    def eagle3_drafter(
        context: dg.AssetExecutionContext,
        training_launcher: TrainingLauncher,
        target: TargetModel,
        compute: Compute,
        training: TrainingRecipe,
        generation: GenerationRecipe,
        hidden: HiddenStatesRecipe,
        storage: Storage,
    ) -> dg.MaterializeResult:
        if hidden.mode != mode:
            raise dg.Failure(
                f"EAGLE3_HIDDEN_STATES_MODE: the code location loaded {mode}, the run found "
                f"{hidden.mode}; reload the code location after changing it"
            )
        if training_launcher.kind == "subprocess":  # a pod's ranks check their own torch
            compute.require(sys.executable, training.nproc, "training")
        selection, left_out = usable_batches(context.instance, mode, storage)
        for message in left_out:
            context.log.warning(message)
        if not selection.usable:
            raise dg.Failure(
                f"no {asset} batch passed its checks: materialize {asset}"
                + (
                    f"; {len(left_out)} left out:\n" + "\n".join(left_out) if left_out else " first"
                ),
                metadata={"excluded_batches": "\n".join(left_out) or "none"},
            )
        promoted = Registry(storage.path("promotion")).current()
        warm_start = Path(promoted.path) if promoted else storage.path("drafter", "warm_start")
        new, exclude = training_data(selection.usable, promoted, training.replay_share, storage)
        if promoted is not None:
            context.log.info(
                f"warm start {promoted.name}: {len(new)} new batches ({', '.join(new)}); of the "
                f"batches it learnt, {training.replay_share:.0%} replayed by id "
                f"({len(exclude)} samples left out)"
            )
        context.add_asset_metadata(
            {
                "hidden_states": mode,
                "batches": ", ".join(selection.usable),
                "new_batches": ", ".join(new),
                "replay_excluded_samples": len(exclude),
                "excluded_batches": "\n".join(left_out) or "none",
                "target": target.path,
                "warm_start": dg.MetadataValue.path(str(warm_start)),
                "warm_start_version": promoted.name if promoted else "hub warm start",
            }
        )
        run: dict = {
            "warm_start": str(warm_start),
            "target": target.path,
            **({"exclude_samples": exclude} if exclude else {}),  # keys of earlier runs kept
            **training.run_settings(),
            "platform": compute.platform,
        }
        if mode == "streamed":
            stream, streamed = streamed_run(
                context, selection.usable, target, generation, hidden, storage
            )
            run |= {"batch_dirs": [], "stream": stream}
            keyed = {**run, "stream": {**stream, "sequences": streamed}}
        else:
            run["batch_dirs"] = [str(storage.path("hidden_states", b)) for b in selection.usable]
            keyed = dict(run)
        for unkeyed in UNKEYED:
            keyed.pop(unkeyed)
        # the world size too: a checkpoint holds each rank's data position, for that many ranks
        keyed["world_size"] = training.nproc * training.nnodes
        key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
        out_dir = storage.path("drafter", "runs", key)
        out_dir.mkdir(parents=True, exist_ok=True)
        if mode == "streamed":
            run["stream"]["spool"] = str(out_dir / "stream" / "spool")
        run_file = out_dir / "run.json"
        run_file.write_text(json.dumps({**run, "out_dir": str(out_dir)}, indent=1))
        context.log.info(
            f"{len(selection.usable)} batches, {training.nnodes} node(s) x {training.nproc} "
            f"rank(s), {training.steps} steps, hidden states {mode}: {out_dir}"
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

    return eagle3_drafter


eagle3_drafter = build_eagle3_drafter(HiddenStatesRecipe.from_env().mode)
