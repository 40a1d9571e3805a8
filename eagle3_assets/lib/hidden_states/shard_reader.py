"""Stream training samples out of hidden-state shards with bounded memory.

Terabytes of shards never fit in RAM: shards are memory-mapped and a sample is read only when
it is yielded, so memory holds one sample plus a few open files however many batches there
are. Shuffling is two-level, as for any dataset larger than memory: the shard order is
permuted per epoch, then a buffer of sample *indices* shuffles within a window. Under DDP each
rank takes every world_size-th sample of the same global order (the tail that does not divide
evenly is dropped, so ranks take the same number of steps). The order is a pure function of
(seed, epoch, rank), so a resumed trainer skips `start` samples and sees exactly what an
uninterrupted one would. `select` keeps samples by id: training and its held-out split read
the same shards and never share a sample.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from eagle3_assets.lib.core.splits import held_out
from eagle3_assets.lib.hidden_states.extract import read_manifest
from eagle3_assets.lib.hidden_states.shard_format import HiddenSample, ShardFile


class ShardReader:
    def __init__(
        self,
        batch_dirs: Sequence[Path],
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 64,
        dtype: torch.dtype = torch.float32,
        open_files: int = 4,
        select: Callable[[str], bool] = lambda sample_id: True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), found {rank}")
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer, self.dtype, self.open_files = shuffle_buffer, dtype, open_files
        self.shards: list[tuple[Path, list[int]]] = []  # (path, indices of selected samples)
        layer_ids = None
        for batch_dir in batch_dirs:
            manifest = read_manifest(Path(batch_dir))
            ids = manifest["layer_ids"]
            if layer_ids is not None and ids != layer_ids:
                raise ValueError(
                    f"{batch_dir}: layer ids {ids} differ from the first batch's {layer_ids}; "
                    "every batch must be extracted at the drafter's layers"
                )
            layer_ids = ids
            for name, entry in manifest["shards"].items():
                chosen = [i for i, sample_id in enumerate(entry["samples"]) if select(sample_id)]
                if chosen:
                    self.shards.append((Path(batch_dir) / name, chosen))
        if layer_ids is None:
            raise ValueError("no hidden-state batches to read")
        self.layer_ids: dict = layer_ids
        self._files: OrderedDict[Path, ShardFile] = OrderedDict()
        self._orders = EpochOrders(seed, rank, world_size, shuffle_buffer)
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Samples per rank per epoch."""
        return sum(len(chosen) for _, chosen in self.shards) // self.world_size

    def order(self, epoch: int) -> list[tuple[int, int]]:
        """This rank's (shard, sample) indices for `epoch`, in reading order."""
        chosen = [indices for _, indices in self.shards]
        return self._orders(chosen, epoch)

    def length(self, shard: int, index: int) -> int:
        """A sample's token count, from its shard's offsets (no states read), each shard's
        read once: step sizing asks for every sample, in shuffled order."""
        if shard not in self._offsets:
            self._offsets[shard] = self._file(self.shards[shard][0]).token_offsets
        offsets = self._offsets[shard]
        return offsets[index + 1] - offsets[index]

    def samples(self, epoch: int = 0, start: int = 0) -> Iterator[HiddenSample]:
        """This rank's samples of `epoch`, from its `start`-th on."""
        for shard, index in self.order(epoch)[start:]:
            yield self._file(self.shards[shard][0]).sample(index, self.dtype)

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each target token is a response token, over every shard (ids and masks
        only: the states are not read)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for path, _ in self.shards:
            shard = self._file(path)
            ids, mask = shard.tensor("input_ids").long(), shard.tensor("loss_mask")
            counts += torch.bincount(ids[mask], minlength=vocab_size)
        return counts

    def _file(self, path: Path) -> ShardFile:
        if path in self._files:
            self._files.move_to_end(path)
        else:
            self._files[path] = ShardFile(path)
            if len(self._files) > self.open_files:
                self._files.popitem(last=False)
        return self._files[path]


def epoch_order(
    shards: Sequence[Sequence[int]],
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    shuffle_buffer: int,
) -> list[tuple[int, int]]:
    """Rank `rank`'s (shard, sample) pairs of `epoch`, given each shard's selected sample
    indices: the one definition of the order, shared by stored shards and streamed runs (which
    plan the shards extraction would write), so both train on the same samples in the same order."""
    order = list(range(len(shards)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    stream = [(s, i) for s in order for i in shards[s]]
    per_rank = len(stream) // world_size
    mine = stream[rank : per_rank * world_size : world_size]
    rng = random.Random(f"{seed}:{epoch}:{rank}")
    buffer: list[tuple[int, int]] = []
    shuffled = []
    for item in mine:
        buffer.append(item)
        if len(buffer) >= shuffle_buffer:
            shuffled.append(buffer.pop(rng.randrange(len(buffer))))
    rng.shuffle(buffer)
    return shuffled + buffer


class EpochOrders:
    """`epoch_order` for one rank, the last epoch's kept: step sizing asks for it every step."""

    def __init__(self, seed: int, rank: int, world_size: int, shuffle_buffer: int) -> None:
        self.args = (seed, rank, world_size, shuffle_buffer)
        self.last: tuple[int, list[tuple[int, int]]] | None = None

    def __call__(self, shards: Sequence[Sequence[int]], epoch: int) -> list[tuple[int, int]]:
        if self.last is None or self.last[0] != epoch:
            seed, rank, world_size, shuffle_buffer = self.args
            self.last = (epoch, epoch_order(shards, seed, epoch, rank, world_size, shuffle_buffer))
        return self.last[1]


class SampleSource(Protocol):
    """What step sizing reads of a ShardReader or a streamed run's samples."""

    def __len__(self) -> int: ...
    def order(self, epoch: int) -> list[tuple[int, int]]: ...
    def length(self, shard: int, index: int) -> int: ...


def step_samples(
    source: SampleSource, epoch: int, position: int, batch_size: int, tokens: int | None
) -> int:
    """How many samples a rank's step takes from (epoch, position) on, epochs rolling over:
    up to `batch_size`, and with `tokens` no more than fit that many padded tokens (count x
    the longest), at least one (`check_budget` checks it fits). The one rule, for the
    trainer and for the streamed producer that extracts ahead of it."""
    count, longest = 0, 0
    while count < batch_size:
        if position >= len(source):
            epoch, position = epoch + 1, 0
        shard, index = source.order(epoch)[position]
        longer = max(longest, _fitting(source.length(shard, index), tokens))
        if tokens is not None and (count + 1) * longer > tokens:
            break
        count, longest, position = count + 1, longer, position + 1
    return count


def check_budget(source: SampleSource, tokens: int | None) -> None:
    """The first epoch's samples against `tokens`, before training starts (a later epoch's
    tail is checked when a step meets it); nothing to read without a budget."""
    if tokens is not None:
        for shard, index in source.order(0):
            _fitting(source.length(shard, index), tokens)


def _fitting(length: int, tokens: int | None) -> int:
    if tokens is not None and length > tokens:
        raise ValueError(
            f"tokens_per_rank (EAGLE3_TRAIN_TOKENS_PER_RANK): expected at least the longest "
            f"sample's {length} tokens, found {tokens}; raise it or lower EAGLE3_MAX_LENGTH"
        )
    return length


def trained_on(fraction: float, exclude: Collection[str] = ()) -> Callable[[str], bool]:
    """`select` for the samples a training run reads: every one neither held out nor in
    `exclude` (learnt batches' samples outside the replay share)."""
    left_out = frozenset(exclude)
    return lambda sample_id: not held_out(sample_id, fraction) and sample_id not in left_out
