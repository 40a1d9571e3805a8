"""Replay: a drafter warm-started from the promoted one trains on the new batches and on a share
of the batches the promoted one already learnt, so what it knew is not forgotten."""

from collections.abc import Iterable

from eagle3_assets.lib.core.splits import held_out

REPLAY_SALT = "replay"  # independent of the held-out splits


def replayed(sample_id: str, share: float) -> bool:
    return held_out(sample_id, share, REPLAY_SALT)


def replay_exclusions(learnt_sample_ids: Iterable[str], share: float) -> list[str]:
    """The samples of already-learnt batches a run leaves out: all but `share` of them, by id."""
    return sorted(i for i in learnt_sample_ids if not replayed(i, share))
