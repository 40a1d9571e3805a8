"""The torchrun command line that launches drafter training, on one node or several.

One node: `--standalone` (a private rendezvous on a free port). Several: the static rendezvous
with an explicit `--node-rank`. Static, not c10d: c10d numbers nodes by sorting their host
names, so global rank 0 (the rank that speaks Dagster Pipes and writes checkpoints) could land
on a node Dagster did not launch, whose process has no Pipes context. With static rendezvous
the node Dagster launches is node 0 and hosts the store at the endpoint; every other node runs
the same command with its own node rank and joins it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_command(
    entry: Sequence[str],
    nproc: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    node_rank: int = 0,
    python: str = sys.executable,
) -> list[str]:
    """`python -m torch.distributed.run <rendezvous> --nproc-per-node=N <entry...>`.

    `entry`: what torchrun starts per rank, e.g. ["-m", "eagle3_assets.training_entry", RUN].
    `rdzv_endpoint`: "host:port" of node 0, reachable from every node (nnodes > 1 only).
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1, found {nproc} and {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} is outside 0..{nnodes - 1}")
    if nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        host, colon, port = (rdzv_endpoint or "").rpartition(":")
        if not (host and colon and port.isdigit()):
            raise ValueError(
                f"{nnodes} nodes need a rendezvous endpoint 'host:port' on node 0, "
                f"found {rdzv_endpoint!r}"
            )
        rendezvous = [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv_endpoint}",
        ]
    return [
        python,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={nproc}",
        *entry,
    ]
