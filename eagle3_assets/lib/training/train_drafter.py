"""One training run of an EAGLE-3 drafter: warm start, shards in, checkpoints and a vLLM
export out; resumable, interruptible, data-parallel.

- Resume is exact: model, AdamW moments, schedule, step and each rank's data position (the
  order is a function of seed and epoch; nothing else is random) go into an atomic
  checkpoint (a directory renamed into place, then `latest` rewritten), all tensors in
  safetensors, scalars in JSON: nothing is ever unpickled.
- fp32 master weights and AdamW state; bf16 autocast on GPUs, fp32 on the CPU.
- SIGINT/SIGTERM (a Dagster cancel) finish the current step, checkpoint and exit with
  `Interrupted`; the next run continues from there.
- Under torchrun every rank reads its own slice of the same sample order and
  DistributedDataParallel averages the gradients during backward, bucket by bucket (gloo on
  CPU, NCCL on GPUs); rank 0 reports and writes. One rank runs the drafter unwrapped.
- A stable `holdout_fraction` of the samples (by id) is never trained on: `heldout_accuracy`
  measures any drafter on it, the offline view for users without a free serving GPU.
- The samples come from stored shards or, with `stream`, from a producer extracting them
  while the run trains (lib/hidden_states/streaming.py): the same order either way.
- Each rank appends what every step consumed to `consumed/rank-K.jsonl`; a resume cuts it
  back to the checkpoint, so the record says exactly which samples made the weights.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from eagle3_assets.lib.checkpoint.drafter_io import (
    read_drafter,
    write_vllm_drafter,
)
from eagle3_assets.lib.core.atomic_files import write_atomically
from eagle3_assets.lib.core.layer_ids import fc_order
from eagle3_assets.lib.core.platform import DEFAULT_PLATFORM, Platform, TorchBuild, check_gpus
from eagle3_assets.lib.core.splits import held_out
from eagle3_assets.lib.core.target import TargetShape, target_config
from eagle3_assets.lib.hidden_states.extract import read_manifest
from eagle3_assets.lib.hidden_states.shard_reader import (
    ShardReader,
    check_budget,
    step_samples,
    trained_on,
)
from eagle3_assets.lib.hidden_states.streaming import (
    Producer,
    ProducerFailed,
    ProducerRun,
    StreamedSamples,
    StreamSpec,
    read_status,
)
from eagle3_assets.lib.training.eagle3_model import Eagle3Drafter, scratch_config
from eagle3_assets.lib.training.settings import DEFAULTS
from eagle3_assets.lib.training.ttt import (
    TargetHead,
    cosine_with_warmup,
    derive_vocab_maps,
    make_batch,
    remap_lm_head,
    supervised_samples,
    ttt_loss,
)

LATEST = "latest"


class Interrupted(RuntimeError):
    """A signal stopped training after a checkpoint was written."""


class LayerMismatch(ValueError):
    """The drafter reads other target layers than the hidden states hold."""


@dataclass(frozen=True)
class RunConfig:
    batch_dirs: list[str]
    warm_start: str | None  # a drafter directory (SpecForge or speculators); None: scratch
    target: str  # the target's folder: config.json and safetensors (norm, lm_head, embed)
    out_dir: str
    steps: int
    batch_size: int = DEFAULTS.batch_size  # samples per rank per step, at most
    tokens_per_rank: int | None = DEFAULTS.tokens_per_rank  # padded tokens per rank per step
    activation_checkpointing: bool = DEFAULTS.activation_checkpointing
    export_dtype: str = DEFAULTS.export_dtype
    platform: Platform = DEFAULT_PLATFORM
    ttt_length: int = DEFAULTS.ttt_length
    decay: float = 0.8
    lr: float = DEFAULTS.lr
    warmup_ratio: float = DEFAULTS.warmup_ratio
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = DEFAULTS.checkpoint_every
    shuffle_buffer: int = 64
    seed: int = DEFAULTS.seed
    rederive_vocab: bool = False  # replace the warm start's d2t/t2d (lm_head rows remapped)
    draft_vocab_size: int = 32000  # from scratch only (a warm start has its own)
    holdout_fraction: float = DEFAULTS.holdout_fraction  # kept out for heldout_accuracy
    stream: dict | None = None  # a StreamSpec: states streamed, not read from batch_dirs
    exclude_samples: list[str] = field(default_factory=list)  # by id: outside the replay share

    @classmethod
    def from_json(cls, path: Path) -> RunConfig:
        return cls(**json.loads(path.read_text()))


@dataclass
class Progress:
    step: int = 0
    epoch: int = 0
    position: int = 0  # samples this rank consumed in the epoch
    tokens: int = 0
    history: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class TrainingResult:
    steps: int
    tokens: int
    seconds: float
    history: list[dict]
    checkpoint: Path
    export: Path


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _reader(config: RunConfig, rank: int, world: int) -> ShardReader | StreamedSamples:
    """This rank's training samples, stored or streamed, held-out ones left out by id."""
    select = trained_on(config.holdout_fraction, config.exclude_samples)
    if config.stream is not None:
        spec = StreamSpec(**config.stream)
        return StreamedSamples(spec, config.seed, rank, world, config.shuffle_buffer, select=select)
    return ShardReader(
        [Path(d) for d in config.batch_dirs],
        seed=config.seed,
        rank=rank,
        world_size=world,
        shuffle_buffer=config.shuffle_buffer,
        select=select,
    )


def _drafter(
    config: RunConfig, head: TargetHead, reader: ShardReader | StreamedSamples
) -> tuple[Eagle3Drafter, tuple[int, ...]]:
    """The model to train and its aux ids: the warm start (its d2t/t2d kept unless the run
    re-derives them, lm_head rows following their tokens), or, without one, a fresh drafter
    shaped like the target at the layers the shards hold, its vocab from their responses."""
    target = target_config(Path(config.target))
    if config.warm_start is None:
        model = Eagle3Drafter(scratch_config(target, config.draft_vocab_size), head.embed)
        d2t, t2d = derive_vocab_maps(
            reader.response_token_counts(model.config.vocab_size), model.config.draft_vocab_size
        )
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        return model, tuple(reader.layer_ids["aux"])
    return load_drafter(
        Path(config.warm_start),
        head,
        reader,
        TargetShape.from_fields(target),
        config.rederive_vocab,
    )


def load_drafter(
    path: Path,
    head: TargetHead,
    reader: ShardReader,
    target: TargetShape,
    rederive_vocab: bool = False,
    aux_layer_ids: Sequence[int] | None = None,
) -> tuple[Eagle3Drafter, tuple[int, ...]]:
    """A saved drafter (SpecForge, speculators or our export) that fits the target, and the
    aux layers it reads: its config's, or `aux_layer_ids` (vLLM ids) when given, as the layer
    probe reads one drafter both ways. `aux_columns` says where the shards hold them."""
    checkpoint = read_drafter(path, target)  # validated for the target, as at download
    aux_ids = (
        checkpoint.aux_layer_ids.fc_order if aux_layer_ids is None else fc_order(aux_layer_ids)
    )
    tensors = dict(checkpoint.tensors)
    if rederive_vocab:  # every rank counts every shard: the same maps everywhere
        counts = reader.response_token_counts(checkpoint.config.vocab_size)
        d2t, t2d = derive_vocab_maps(counts, checkpoint.config.draft_vocab_size)
        tensors["lm_head.weight"] = remap_lm_head(tensors["lm_head.weight"], tensors["d2t"], d2t)
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    model = Eagle3Drafter(checkpoint.config, head.embed)
    model.load_state_dict(tensors)
    return model, aux_ids


def aux_columns(reader: ShardReader, aux_ids: Sequence[int], drafter: object) -> list[int] | None:
    """Where the shards hold the drafter's aux layers (None: all of them, in order). Shards
    may hold more layers than a drafter reads (the layer probe extracts both readings of a
    config at once); a layer they lack is a LayerMismatch."""
    held = list(reader.layer_ids["aux"])
    if list(aux_ids) == held:
        return None
    if not set(aux_ids) <= set(held):
        raise LayerMismatch(
            f"hidden states hold aux layers {held} (vLLM ids), the drafter at {drafter} "
            f"reads {list(aux_ids)}: re-extract the batches at the drafter's layers"
        )
    return [held.index(i) for i in aux_ids]


def trained_aux_layers(run: RunConfig) -> tuple[int, ...]:
    """The aux layers (vLLM ids, fc order) a run trained on, stored or streamed."""
    if run.stream is not None:
        return tuple(run.stream["layers"]["aux"])
    return tuple(read_manifest(Path(run.batch_dirs[0]))["layer_ids"]["aux"])


def _device(platform: Platform) -> torch.device:
    """This rank's GPU under torchrun (LOCAL_RANK) on cuda, the CPU on cpu; a cuda rank whose
    torch sees no GPU for it fails here, before any work."""
    if platform == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_gpus(TorchBuild.here(), local_rank + 1, f"training rank {local_rank}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _samples(reader: ShardReader | StreamedSamples, progress: Progress) -> Iterator:
    """Endless (epoch, sample) from the progress's (epoch, position) on, advancing it."""
    while True:
        for sample in reader.samples(progress.epoch, progress.position):
            progress.position += 1
            yield progress.epoch, sample
        progress.epoch, progress.position = progress.epoch + 1, 0


class ConsumptionRecord:
    """One JSON line per step: the (epoch, sample id) pairs this rank trained on. Lines past
    the checkpoint a run resumes from are cut (their updates died with the run), so the record
    holds each sample of an epoch exactly once however often the run was killed."""

    def __init__(self, out_dir: Path, rank: int, resumed_step: int) -> None:
        self.path = out_dir / "consumed" / f"rank-{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # the last line of a killed run
                    break
                if entry["step"] > resumed_step:
                    break
                kept.append(line + "\n")
        write_atomically(self.path, "".join(kept).encode())
        self.file = self.path.open("a")

    def append(self, step: int, consumed: list[tuple[int, str]]) -> None:
        self.file.write(json.dumps({"step": step, "samples": consumed}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _start_producer(
    config: RunConfig, progress: Progress, rank: int, world: int, out_dir: Path
) -> Producer | None:
    """Rank 0 starts the streamed run's producer at every rank's position (from the
    checkpoint), on a spool cleaned of a dead run's files; no rank reads before that."""
    if config.stream is None or progress.step >= config.steps:
        return None
    start = [progress.epoch, progress.position]
    if world > 1:
        starts: list = [None] * world
        dist.all_gather_object(starts, start)
    else:
        starts = [start]
    producer = None
    if rank == 0:
        run = ProducerRun(
            spec=config.stream,
            seed=config.seed,
            world_size=world,
            shuffle_buffer=config.shuffle_buffer,
            holdout_fraction=config.holdout_fraction,
            exclude_samples=config.exclude_samples,
            batch_size=config.batch_size,
            steps=config.steps - progress.step,
            starts=starts,
            tokens_per_rank=config.tokens_per_rank,
            platform=config.platform,
        )
        producer = Producer(run, out_dir / "producer-run.json")
    if world > 1:
        dist.barrier()
    return producer


def _stream_metrics(config: RunConfig, reader: ShardReader | StreamedSamples) -> dict:
    """The streamed run's side of a step: the producer's status and this rank's waits."""
    if config.stream is None:
        return {}
    status = read_status(StreamSpec(**config.stream))
    seconds = status.get("seconds") or 0.0
    return {
        "trainer_waited_s": reader.waited_s,
        "producer_waited_s": status.get("waited_s", 0.0),
        "producer_tokens": status.get("tokens", 0),
        "producer_tokens_per_s": status.get("tokens", 0) / seconds if seconds else 0.0,
        "spool_peak_bytes": status.get("peak_bytes", 0),
        "spool_window_bytes": status.get("window_bytes", 0),
        "spool_bytes": reader.spool.bytes(),
    }


class _StopFlag:
    """Turns SIGINT/SIGTERM into a flag checked between steps."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {s: signal.signal(s, self._set) for s in (signal.SIGINT, signal.SIGTERM)}

    def _set(self, signum: int, frame: object) -> None:
        self.signal = signum

    def anywhere(self, world: int, device: torch.device) -> bool:
        """Whether any rank was signalled: ranks get the signal at slightly different points
        of a step, and all must stop after the same step or their collectives deadlock."""
        if world == 1:
            return self.signal is not None
        flag = torch.tensor([0 if self.signal is None else 1], device=device)  # NCCL: on GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def training_objective(model: Eagle3Drafter, world: int) -> torch.nn.Module:
    """The module `ttt_loss` runs: the drafter on one rank, on several the drafter in
    DistributedDataParallel, whose gradients come out of backward averaged over the ranks,
    bucket by bucket (no copy). Its buffers (the vocab maps) are built alike on every rank
    and never trained: not broadcast before every forward."""
    if world == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, broadcast_buffers=False, gradient_as_bucket_view=True
    )


def train(
    config: RunConfig, report: Callable[[dict], None] = lambda metrics: None
) -> TrainingResult:
    rank, world = _rank()
    device = _device(config.platform)
    torch.manual_seed(config.seed)
    head = TargetHead(Path(config.target)).to(device)
    reader = _reader(config, rank, world)
    model, aux_ids = _drafter(config, head, reader)
    columns = aux_columns(reader, aux_ids, config.warm_start or "scratch")
    model.float().to(device)  # fp32 master weights; bf16 autocast on GPUs
    model.checkpoint_steps = config.activation_checkpointing
    check_budget(reader, config.tokens_per_rank)  # a sample over the budget fails now
    if len(reader) < config.batch_size:
        raise ValueError(
            f"{len(reader)} samples per rank, fewer than batch_size {config.batch_size}"
        )
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        parameters, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
    )
    warmup = max(1, round(config.warmup_ratio * config.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, config.steps, warmup)
    )
    out_dir = Path(config.out_dir)
    progress = _resume(out_dir, rank, model, optimizer, schedule) or Progress()
    record = ConsumptionRecord(out_dir, rank, progress.step)
    samples = _samples(reader, progress)
    objective = training_objective(model, world)
    stop = _StopFlag()
    producer = _start_producer(config, progress, rank, world, out_dir)
    started = time.monotonic()
    try:
        while progress.step < config.steps:
            count = step_samples(
                reader, progress.epoch, progress.position, config.batch_size, config.tokens_per_rank
            )
            consumed = [next(samples) for _ in range(count)]
            batch_samples = [sample for _, sample in consumed]
            batch = make_batch(batch_samples, head, model.t2d, config.ttt_length, columns)
            divisors = None  # one rank: each step's mean over its samples
            if world > 1:  # ranks may hold unequal counts: divide by the total / world
                totals = torch.tensor(supervised_samples(batch, config.ttt_length), device=device)
                dist.all_reduce(totals)
                divisors = [total / world for total in totals.tolist()]
            with mixed_precision(device):
                loss, losses, hits, counts, _ = ttt_loss(
                    objective, batch, config.ttt_length, config.decay, divisors
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            losses = [float(loss.detach()), *losses]
            tokens = sum(len(s.input_ids) for s in batch_samples)
            sizes = [
                len(batch_samples),
                len(batch_samples) * max(len(s.input_ids) for s in batch_samples),
            ]
            if world > 1:  # losses: the mean of the ranks' (weighted) losses; the rest: sums
                summed = torch.tensor([*losses, *hits, *counts, tokens, *sizes], device=device)
                dist.all_reduce(summed)
                summed = summed.tolist()
                steps = config.ttt_length
                losses = [value / world for value in summed[: 1 + steps]]
                hits, counts = summed[1 + steps : 1 + 2 * steps], summed[1 + 2 * steps : -3]
                tokens = int(summed[-3])  # each rank's own samples, not rank 0's times world
                sizes = [int(size) for size in summed[-2:]]
            loss_value, losses = losses[0], losses[1:]
            accuracies = [h / max(c, 1) for h, c in zip(hits, counts, strict=True)]
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
            optimizer.step()
            schedule.step()
            progress.step += 1
            progress.tokens += tokens
            record.append(progress.step, [(epoch, s.sample_id) for epoch, s in consumed])
            metrics = {
                "step": progress.step,
                "loss": loss_value,
                "step_losses": losses,
                "accuracy": accuracies,
                "grad_norm": float(grad_norm),
                "lr": schedule.get_last_lr()[0],
                "tokens": progress.tokens,
                "tokens_per_s": progress.tokens / (time.monotonic() - started),
                "samples": sizes[0],  # this step's, over the ranks
                "padded_tokens": sizes[1],
                **(_stream_metrics(config, reader) if rank == 0 else {}),  # rank 0 reports
            }
            progress.history.append(metrics)
            if rank == 0:
                report(metrics)
            interrupted = stop.anywhere(world, device)
            if interrupted or progress.step % config.checkpoint_every == 0:
                _save(out_dir, rank, model, optimizer, schedule, progress)
            if interrupted:
                raise Interrupted(
                    f"signal {stop.signal}: checkpoint at step {progress.step} in {out_dir}"
                )
    except Exception as error:
        # a rank that finds the producer dead stops; the others then fail in a collective
        # ("connection closed by peer"): say what happened, whichever rank reports
        failure = reader.spool.failure() if config.stream is not None else None
        if failure is not None and not isinstance(error, ProducerFailed):
            raise ProducerFailed(failure) from error
        raise
    finally:
        stop.restore()
        record.close()
        if producer is not None:
            producer.stop()
    last = _save(out_dir, rank, model, optimizer, schedule, progress)
    export = out_dir / "export"
    if rank == 0:
        target = TargetShape.from_config(Path(config.target))
        weights = getattr(torch, config.export_dtype)
        write_vllm_drafter(export, model.config, model.state_dict(), aux_ids, target, weights)
    return TrainingResult(
        progress.step,
        progress.tokens,
        time.monotonic() - started,
        progress.history,
        last,
        export,
    )


def mixed_precision(device: torch.device) -> torch.autocast:
    """bf16 autocast on GPUs, where TTT attention's flash kernel takes no fp32; fp32 on the
    CPU. For training and for every measurement of a drafter alike."""
    return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def open_heldout(
    drafter: Path,
    target: Path,
    batch_dirs: Sequence[str],
    holdout_fraction: float,
    aux_layer_ids: Sequence[int] | None = None,
    head: TargetHead | None = None,
    platform: Platform = DEFAULT_PLATFORM,
) -> tuple[Eagle3Drafter, TargetHead, ShardReader, list[int] | None]:
    """(drafter in fp32 eval mode, teacher, reader of the held-out samples in a fixed order,
    the shards' columns of the aux layers it reads) on this rank's device: what every
    measurement of a saved drafter on held-out states starts from. `head`: a teacher already
    read, so that reading one drafter several ways loads the target's weights once."""
    device = _device(platform)
    head = TargetHead(target).to(device) if head is None else head
    reader = ShardReader(
        [Path(d) for d in batch_dirs],
        shuffle_buffer=1,
        select=lambda sample_id: held_out(sample_id, holdout_fraction),
    )
    model, aux_ids = load_drafter(
        drafter, head, reader, TargetShape.from_config(target), aux_layer_ids=aux_layer_ids
    )
    columns = aux_columns(reader, aux_ids, drafter)
    return model.float().to(device).eval(), head, reader, columns


def heldout_accuracy(
    drafter: Path,
    target: Path,
    batch_dirs: list[str],
    holdout_fraction: float,
    ttt_length: int,
    batch_size: int = 8,
    aux_layer_ids: Sequence[int] | None = None,
    platform: Platform = DEFAULT_PLATFORM,
) -> dict:
    """Per-position TTT accuracy of a saved drafter on the held-out samples of the shards:
    the training-time view of a drafter (teacher-forced on the target's own states), not
    acceptance in a serving engine. `aux_layer_ids` (vLLM ids) reads the drafter at those
    layers instead of its config's. {"samples", "tokens", "accuracy": [...] (None: no
    held-out sample), "sample_loss": [...], "draft_vocab_size"}: the step-0 loss of each
    sample that step 0 supervises, in the reader's order (the layer probe weighs their mean
    against a uniform guess over the draft vocab)."""
    model, head, reader, columns = open_heldout(
        drafter, target, batch_dirs, holdout_fraction, aux_layer_ids, platform=platform
    )
    hits, counts = [0] * ttt_length, [0] * ttt_length
    sample_loss: list[float] = []
    samples = reader.samples()  # streamed: held-out states of a big target do not fit in RAM
    while chunk := list(itertools.islice(samples, batch_size)):
        batch = make_batch(chunk, head, model.t2d, ttt_length, columns)
        with mixed_precision(model.lm_head.weight.device):
            _, _, batch_hits, batch_counts, losses = ttt_loss(model, batch, ttt_length, 1.0)
        hits = [a + b for a, b in zip(hits, batch_hits, strict=True)]
        counts = [a + b for a, b in zip(counts, batch_counts, strict=True)]
        sample_loss += losses
    return {
        "samples": len(reader),
        "tokens": counts[0],
        "accuracy": [h / c for h, c in zip(hits, counts, strict=True)] if counts[0] else None,
        "sample_loss": sample_loss,
        "draft_vocab_size": model.config.draft_vocab_size,
    }


def _save(out_dir: Path, rank: int, model, optimizer, schedule, progress: Progress) -> Path:
    """checkpoints/step-N/ with rank 0's model and optimizer and every rank's data position;
    a directory renamed into place, then `latest` rewritten: never half a checkpoint."""
    checkpoints = out_dir / "checkpoints"
    final = checkpoints / f"step-{progress.step:07d}"
    rank_state = {"epoch": progress.epoch, "position": progress.position}
    if dist.is_available() and dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rank_state)
    else:
        gathered = [rank_state]
    if rank == 0 and not (final / "state.json").exists():
        staging = checkpoints / f".staging-{progress.step:07d}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            staging / "model.safetensors",
        )
        save_file(_optimizer_tensors(optimizer), staging / "optimizer.safetensors")
        state = {
            "step": progress.step,
            "tokens": progress.tokens,
            "schedule": schedule.state_dict()["last_epoch"],
            "ranks": gathered,
            "history": progress.history,
        }
        (staging / "state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        write_atomically(checkpoints / LATEST, final.name.encode())
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return final


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors


def _resume(out_dir: Path, rank: int, model, optimizer, schedule) -> Progress | None:
    latest = out_dir / "checkpoints" / LATEST
    if not latest.exists():
        return None
    directory = latest.parent / latest.read_text().strip()
    state = json.loads((directory / "state.json").read_text())
    model.load_state_dict(load_file(directory / "model.safetensors"))
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(directory / "optimizer.safetensors").items():
        index, name = key.split(".", 1)
        moments.setdefault(int(index), {})[name] = value
    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = moments
    optimizer.load_state_dict(optimizer_state)
    schedule.last_epoch = state["schedule"]
    for group, lr in zip(optimizer.param_groups, schedule.get_lr(), strict=True):
        group["lr"] = lr
    mine = state["ranks"][rank]
    return Progress(
        step=state["step"],
        epoch=mine["epoch"],
        position=mine["position"],
        tokens=state["tokens"],
        history=state["history"],
    )


@contextmanager
def distributed(platform: Platform) -> Iterator[None]:
    """The process group when torchrun started several ranks (gloo on CPU, NCCL on GPUs)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if platform == "cuda" else "gloo")
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def training_metadata(config: RunConfig, result: TrainingResult) -> dict:
    """What the finished run reports: numbers a user compares across runs. No serve line:
    drafter_evaluation gives it, with the speculative tokens it measured."""
    last = result.history[-1] if result.history else {}
    return {
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "tokens_per_s": round(result.tokens / result.seconds, 1) if result.seconds else 0.0,
        "final_loss": round(last.get("loss", float("nan")), 4),
        "final_accuracy_by_position": [round(a, 4) for a in last.get("accuracy", [])],
        "loss_curve": [round(m["loss"], 4) for m in result.history],
        "checkpoint": str(result.checkpoint),
        "export": str(result.export),
        "lr": config.lr,
        "ttt_length": config.ttt_length,
        **stream_summary(last),
    }


def stream_summary(metrics: dict) -> dict:
    """A streamed run's totals from its last step: the spool's peak against its window, the
    producer's rate, and the seconds each side waited on the other (the other side was the
    bottleneck); empty for a stored run."""
    if "spool_peak_bytes" not in metrics:
        return {}
    producer_waited, trainer_waited = metrics["producer_waited_s"], metrics["trainer_waited_s"]
    return {
        "spool_peak_bytes": metrics["spool_peak_bytes"],
        "spool_window_bytes": metrics["spool_window_bytes"],
        "producer_tokens": metrics["producer_tokens"],
        "producer_tokens_per_s": round(metrics["producer_tokens_per_s"], 1),
        "producer_waited_s": round(producer_waited, 1),
        "trainer_waited_s": round(trainer_waited, 1),
        "bottleneck": "producer" if trainer_waited > producer_waited else "trainer",
    }


def main(argv: list[str] | None = None) -> int:
    """`torchrun ... -m eagle3_assets.lib.training.train_drafter RUN.json`: one process per rank,
    metrics as JSON lines on rank 0's stdout."""
    args = sys.argv[1:] if argv is None else argv
    config = RunConfig.from_json(Path(args[0]))
    with distributed(config.platform):
        try:
            result = train(config, report=lambda m: print(json.dumps(m), flush=True))
        except Interrupted as stopped:
            print(str(stopped), flush=True)
            return 130
    print(json.dumps({"done": training_metadata(config, result)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
