"""Hidden states streamed to training instead of stored: extracted while the drafter trains,
each epoch anew, never more than a bounded window on disk.

- **The order is the stored one.** A streamed run plans the shards extraction would write
  (`plan_shards`, from sizes alone) and reads them in `epoch_order`, the function a
  `ShardReader` uses: with the same batches and settings both modes train on the same samples
  in the same order, and a streamed drafter equals a stored one.
- **One producer, a bounded spool.** The producer (its own process, started by rank 0, killed
  with it) walks the ranks' orders step by step, captures each step's samples with the
  configured backend (`hf` in-process or a vLLM extraction server), encodes them as stored
  shards encode them, and writes one file per sample into the spool. It waits while the spool
  holds more than the window (backpressure). A rank waits for its next file, reads it and
  deletes it: each rank takes its own share, in order.
- **Resume.** The spool is cleaned when a run starts; the producer starts from the positions
  in the trainer's last checkpoint (a step boundary, so its capture groups are those of an
  uninterrupted run). Nothing in the spool needs to survive a crash.
- **Failure.** A producer that raises or dies leaves a `FAILED` note in the spool; every rank
  waiting for a file raises with it, so no rank hangs on a sample that will never come.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from eagle3_assets.lib.core.atomic_files import write_atomically
from eagle3_assets.lib.core.platform import DEFAULT_PLATFORM, Platform
from eagle3_assets.lib.hidden_states.extract import LayerSelection, encode_states, plan_shards
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.hidden_states.shard_format import HiddenSample, ShardFile, shard_bytes
from eagle3_assets.lib.hidden_states.shard_reader import EpochOrders, step_samples, trained_on
from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence

FAILED = "FAILED"
STATUS = "producer-status.json"
POLL_S = 0.01


def write_sequences(path: Path, batches: Mapping[str, Sequence[TokenSequence]]) -> None:
    """Every batch's token sequences in one safetensors file: what the producer extracts and
    the ranks plan from, tokenized once by the asset (the one renderer, `build_sequences`)."""
    sequences = [s for batch in batches.values() for s in batch]
    lengths = [len(s) for s in sequences]
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in sequences])),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in sequences])),
        "offsets": torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int64),
    }
    header = {
        "batches": {name: [s.sample_id for s in batch] for name, batch in batches.items()},
        "truncated": [s.sample_id for s in sequences if s.truncated],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, save(tensors, metadata={"sequences": json.dumps(header)}))


def read_sequences(path: Path) -> dict[str, list[TokenSequence]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        header = json.loads(file.metadata()["sequences"])
    tensors = load_file(path)
    ids, mask, offsets = (
        tensors["input_ids"].numpy(),
        tensors["loss_mask"].numpy(),
        tensors["offsets"],
    )
    truncated, batches, at = set(header["truncated"]), {}, 0
    for name, sample_ids in header["batches"].items():
        batches[name] = []
        for sample_id in sample_ids:
            start, end = int(offsets[at]), int(offsets[at + 1])
            sequence = TokenSequence(
                sample_id, ids[start:end], mask[start:end], sample_id in truncated
            )
            batches[name].append(sequence)
            at += 1
    return batches


@dataclass(frozen=True)
class StreamSpec:
    """What a streamed run extracts, and how: written by the asset into the run, read by the
    producer and by every rank."""

    sequences: str  # write_sequences' file
    spool: str  # the directory between the producer and the ranks
    settings: dict  # HiddenStatesSettings: backend, format, window, shard plan, dtype, server
    layers: dict  # LayerSelection: aux (fc order), final, source; vLLM ids
    hidden_size: int
    target: str
    trust_remote_code: bool
    server_dir: str  # the vllm backend's extraction server's run dir

    def extraction(self) -> HiddenStatesSettings:
        return HiddenStatesSettings(**self.settings)

    def layer_selection(self) -> LayerSelection:
        return LayerSelection(
            tuple(self.layers["aux"]), self.layers["final"], self.layers["source"]
        )


def window_error(
    settings: HiddenStatesSettings, sequences: Sequence[TokenSequence], hidden: int, num_aux: int
) -> str | None:
    """Why the window cannot hold the largest sample (it must, or the producer could never
    write it), naming both sizes; None when it can."""
    from eagle3_assets.lib.hidden_states.extract import human_bytes

    fmt = settings.extraction().format

    def size(s: TokenSequence) -> int:
        return fmt.estimate(len(s), len(s.teacher_positions), 1, hidden, num_aux)

    largest = max(sequences, key=size)
    if size(largest) <= settings.window_bytes:
        return None
    return (
        f"stream_window_mb: the window ({human_bytes(settings.window_bytes)}) is smaller than "
        f"one sample: {largest.sample_id} ({len(largest)} tokens) takes "
        f"{human_bytes(size(largest))} in {fmt.name}; raise EAGLE3_STREAM_WINDOW_MB to at "
        f"least {size(largest) / 2**20:.3f} or lower max_length"
    )


class ProducerFailed(RuntimeError):
    """The producer stopped before delivering what the ranks wait for."""


class Spool:
    """A directory holding at most `window_bytes` of sample files (or one sample, when a
    single one is larger than what is free); one writer, many readers, each taking its own."""

    def __init__(self, directory: Path, window_bytes: int) -> None:
        self.directory, self.window_bytes = directory, window_bytes

    @staticmethod
    def name(rank: int, epoch: int, position: int) -> str:
        return f"r{rank:04d}-e{epoch:05d}-p{position:09d}.safetensors"

    def clean(self) -> None:
        """Remove whatever a dead run left: samples, temp files, its failure note."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.directory.iterdir():
            path.unlink()

    def bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.directory):
            with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                total += entry.stat().st_size
        return total

    def put(self, name: str, payload: bytes) -> float:
        """Write a sample once it fits the window; return the seconds spent waiting."""
        started = time.monotonic()
        while (held := self.bytes()) and held + len(payload) > self.window_bytes:
            time.sleep(POLL_S)
        waited = time.monotonic() - started
        staging = self.directory / f".{name}.tmp"
        staging.write_bytes(payload)
        os.replace(staging, self.directory / name)
        return waited

    def take(self, name: str, dtype: torch.dtype) -> tuple[HiddenSample, float]:
        """Wait for a sample, read it, delete it; (sample, seconds waited)."""
        path, started = self.directory / name, time.monotonic()
        while not path.exists():
            if (failure := self.failure()) is not None:
                raise ProducerFailed(failure)
            time.sleep(POLL_S)
        waited = time.monotonic() - started
        sample = ShardFile(path).sample(0, dtype)
        path.unlink()
        return sample, waited

    def fail(self, message: str) -> None:
        if not (self.directory / FAILED).exists():
            write_atomically(self.directory / FAILED, message.encode())

    def failure(self) -> str | None:
        """The producer's failure note, if it failed."""
        with contextlib.suppress(FileNotFoundError):
            return (self.directory / FAILED).read_text()
        return None


class StreamedSamples:
    """A streamed run's samples for one rank, read as a ShardReader reads stored shards: the
    same interface (`layer_ids`, `len`, `order`, `samples`, `response_token_counts`), the same
    order; the states come from the spool."""

    def __init__(
        self,
        spec: StreamSpec,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 64,
        dtype: torch.dtype = torch.float32,
        select: Callable[[str], bool] = lambda sample_id: True,
        batches: Mapping[str, Sequence[TokenSequence]] | None = None,  # read_sequences' result
    ) -> None:
        settings = spec.extraction()
        extraction, layers = settings.extraction(), spec.layer_selection()
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer, self.dtype = shuffle_buffer, dtype
        self.layer_ids = {"convention": "vllm", **asdict(layers)}
        self.spool = Spool(Path(spec.spool), settings.window_bytes)
        self.shards: list[list[TokenSequence]] = []  # planned as extraction would write them
        self.chosen: list[list[int]] = []
        batches = read_sequences(Path(spec.sequences)) if batches is None else batches
        for sequences in batches.values():
            plans = plan_shards(
                sequences,
                extraction.format,
                spec.hidden_size,
                len(layers.aux),
                extraction.shard_bytes,
            )
            for plan in plans:
                members = [sequences[i] for i in plan.samples]
                chosen = [i for i, s in enumerate(members) if select(s.sample_id)]
                if chosen:
                    self.shards.append(members)
                    self.chosen.append(chosen)
        self.waited_s = 0.0
        self._orders = EpochOrders(seed, rank, world_size, shuffle_buffer)

    def __len__(self) -> int:
        return sum(len(chosen) for chosen in self.chosen) // self.world_size

    def order(self, epoch: int) -> list[tuple[int, int]]:
        return self._orders(self.chosen, epoch)

    def sequence(self, shard: int, index: int) -> TokenSequence:
        return self.shards[shard][index]

    def length(self, shard: int, index: int) -> int:
        return len(self.shards[shard][index])

    def samples(self, epoch: int = 0, start: int = 0) -> Iterator[HiddenSample]:
        for position in range(start, len(self)):
            sample, waited = self.spool.take(Spool.name(self.rank, epoch, position), self.dtype)
            self.waited_s += waited
            yield sample

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """As ShardReader counts them: every sample of every planned shard that has a
        selected one (ids and masks only)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for members in self.shards:
            for sequence in members:
                ids = torch.from_numpy(sequence.input_ids[sequence.loss_mask])
                counts += torch.bincount(ids, minlength=vocab_size)
        return counts


@dataclass(frozen=True)
class ProducerRun:
    """What the producer is asked for: the spec, and where each rank resumes."""

    spec: dict
    seed: int
    world_size: int
    shuffle_buffer: int
    holdout_fraction: float
    batch_size: int
    steps: int  # steps still to train
    starts: list[list[int]]  # per rank: [epoch, position]
    exclude_samples: list[str] = field(default_factory=list)  # as RunConfig's
    tokens_per_rank: int | None = None  # as RunConfig's
    platform: Platform = DEFAULT_PLATFORM  # as RunConfig's


def schedule(
    readers: Sequence[StreamedSamples],
    starts: Sequence[Sequence[int]],
    steps: int,
    batch_size: int,
    tokens_per_rank: int | None = None,
) -> Iterator[list[tuple[str, TokenSequence]]]:
    """Per training step, the (spool name, sequence) of every sample each rank takes, rank by
    rank: the order the producer writes in, each rank's share sized by the trainer's rule
    (`step_samples`). Epochs roll over as `train` rolls them."""
    cursors = [list(start) for start in starts]
    for _ in range(steps):
        step = []
        for rank, reader in enumerate(readers):
            epoch, position = cursors[rank]
            for _ in range(step_samples(reader, epoch, position, batch_size, tokens_per_rank)):
                if position >= len(reader):
                    epoch, position = epoch + 1, 0
                shard, index = reader.order(epoch)[position]
                step.append((Spool.name(rank, epoch, position), reader.sequence(shard, index)))
                position += 1
            cursors[rank] = [epoch, position]
        yield step


def produce(run: ProducerRun, log: Callable[[str], None] = print) -> dict:
    """Extract and spool every sample the ranks will take, step by step; the status (rates,
    waits, peak spool bytes) is rewritten after each step for the trainer to report."""
    from eagle3_assets.lib.hidden_states.backends import open_backend

    spec = StreamSpec(**run.spec)
    settings = spec.extraction()
    extraction = settings.extraction()
    fmt = extraction.format
    select = trained_on(run.holdout_fraction, run.exclude_samples)
    batches = read_sequences(Path(spec.sequences))  # once, shared by every rank's order
    readers = [
        StreamedSamples(
            spec, run.seed, rank, run.world_size, run.shuffle_buffer, select=select, batches=batches
        )
        for rank in range(run.world_size)
    ]
    spool = readers[0].spool
    layers = spec.layer_selection()
    status = {"pid": os.getpid(), "steps": 0, "samples": 0, "tokens": 0, "peak_bytes": 0}
    status |= {"seconds": 0.0, "waited_s": 0.0, "window_bytes": spool.window_bytes}
    started = time.monotonic()
    backend = open_backend(
        settings,
        run.platform,
        spec.target,
        spec.trust_remote_code,
        layers.ids,
        spec.hidden_size,
        Path(spec.server_dir),
        log,
    )
    with backend as source:
        for step in schedule(readers, run.starts, run.steps, run.batch_size, run.tokens_per_rank):
            sequences = [sequence for _, sequence in step]
            payloads: list[bytes] = [b""] * len(step)
            for index, states in source.capture(sequences, extraction.batch_tokens):
                encoded = encode_states(sequences[index], states, source, extraction.format)
                payloads[index] = shard_bytes([encoded], [step[index][1].sample_id], fmt)
            # in the order the ranks take them: a rank waiting for a sample written after
            # others of its own could wait on a full spool forever
            for (name, sequence), payload in zip(step, payloads, strict=True):
                status["waited_s"] += spool.put(name, payload)
                status["peak_bytes"] = max(status["peak_bytes"], spool.bytes())
                status["samples"] += 1
                status["tokens"] += len(sequence)
            status["steps"] += 1
            status["seconds"] = time.monotonic() - started
            write_atomically(spool.directory.parent / STATUS, json.dumps(status).encode())
    return status


def read_status(spec: StreamSpec) -> dict:
    try:
        return json.loads((Path(spec.spool).parent / STATUS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _die_with_parent() -> None:
    """In the producer, before exec: SIGKILL when the rank that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Producer:
    """The producer process, owned by rank 0: started on a clean spool, watched (a death
    becomes the spool's FAILED note, which the waiting ranks raise), killed on exit."""

    def __init__(self, run: ProducerRun, run_file: Path) -> None:
        self.spec = StreamSpec(**run.spec)
        self.spool = Spool(Path(self.spec.spool), 0)
        self.spool.clean()
        (self.spool.directory.parent / STATUS).unlink(missing_ok=True)
        write_atomically(run_file, json.dumps(asdict(run)).encode())
        self.log = (self.spool.directory.parent / "producer.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "eagle3_assets.lib.hidden_states.streaming", str(run_file)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            # its OpenMP threads sleep between forwards instead of spinning on the cores the
            # ranks train on (CPU extraction: 768 -> 1,113 training tokens/s on 2 cores)
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        )
        self.stopping = False
        self.watchdog = threading.Thread(target=self._watch, daemon=True)
        self.watchdog.start()

    def _watch(self) -> None:
        code = self.process.wait()
        if code != 0 and not self.stopping:
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            self.spool.fail(
                f"the hidden-states producer (pid {self.process.pid}) died with {how}; see "
                f"{self.log.name}. Materialize again: training resumes from its last checkpoint"
            )

    def stop(self) -> None:
        self.stopping = True
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.watchdog.join()
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3_assets.lib.hidden_states.streaming RUN.json`: the producer. It ignores
    SIGINT/SIGTERM (a cancel lets the ranks finish their step on data it delivers; rank 0 kills
    it then) and notes any failure in the spool before exiting."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    run = ProducerRun(**json.loads(Path(args[0]).read_text()))
    try:
        produce(run, log=lambda message: print(message, flush=True))
    except BaseException:
        Spool(Path(run.spec["spool"]), 0).fail(
            "the hidden-states producer failed:\n" + traceback.format_exc(limit=8)
        )
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
