"""Serving follows promotion: replicas restarted one at a time with the promoted drafter.

One replica at a time, so that the others serve meanwhile. A replica counts as rolled out only
once it is ready, serves the model and its drafter is seen drafting (`confirm`); its spec is
then kept as the run dir's last good one (`good.json`). A replica that does not get there is
started again as it last served well and the rollout stops, the replicas after it untouched:
a failure anywhere leaves the last good drafter serving. Servers run in their own sessions,
so a rollout killed mid-restart leaves the new server loading (or the old one serving); run
again, it finds the new server by its launch record and waits for it instead of restarting.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.lib.core.atomic_files import write_atomically
from eagle3_assets.lib.serving.vllm_launcher import (
    LaunchError,
    VLLMLaunchSpec,
    launched_spec,
    spec_from_json,
    spec_to_json,
    start,
    wait_ready,
    with_eagle3_drafter,
)

GOOD = "good.json"  # the spec last confirmed serving from a run dir


class RolloutError(RuntimeError):
    """A replica did not come up with the new drafter; it serves its last good one again."""


@dataclass(frozen=True)
class Replica:
    run_dir: str
    base_url: str
    drafter: str | None
    confirmation: dict  # what `confirm` measured


def drafter_of(spec: VLLMLaunchSpec) -> str | None:
    return spec.speculative_config["model"] if spec.speculative_config else None


def last_good(run_dir: Path) -> VLLMLaunchSpec | None:
    path = Path(run_dir) / GOOD
    return spec_from_json(json.loads(path.read_text())) if path.exists() else None


def roll_out(
    run_dirs: Sequence[Path],
    drafter: Path | None,
    num_speculative_tokens: int,
    confirm: Callable[[VLLMLaunchSpec], dict],
    ready_timeout_s: float,
    log: Callable[[str], None] = print,
) -> list[Replica]:
    """Serve `drafter` (None: no drafter) from every replica started from `run_dirs`, in turn;
    RolloutError at the first that cannot, once it serves its last good spec again."""
    replicas = []
    for run_dir in map(Path, run_dirs):
        launched = launched_spec(run_dir)
        if drafter is None:
            wanted = dataclasses.replace(launched, speculative_config=None)
        else:
            wanted = with_eagle3_drafter(launched, drafter, num_speculative_tokens)
        good = last_good(run_dir) or launched
        try:
            start(wanted, log)  # a live server started as `wanted` is reused, another stopped
            log(f"{wanted.base_url}: ready with drafter {drafter} after "
                f"{wait_ready(wanted, ready_timeout_s):.0f}s")  # fmt: skip
            confirmation = confirm(wanted)
        except (LaunchError, RuntimeError, OSError) as error:
            log(f"{wanted.base_url}: not rolled out ({error}); serving {drafter_of(good)} again")
            start(good, log)
            wait_ready(good, ready_timeout_s)
            raise RolloutError(
                f"{wanted.base_url} did not serve drafter {drafter}: {error}. It serves its "
                f"last good drafter again ({drafter_of(good)}); replicas after it untouched"
            ) from error
        write_atomically(run_dir / GOOD, json.dumps(spec_to_json(wanted)).encode())
        replicas.append(Replica(str(run_dir), wanted.base_url, drafter_of(wanted), confirmation))
    return replicas
