"""The torchrun command line: one node, several nodes, and two real "nodes" on 127.0.0.1 that
rendezvous through it, proving the node Dagster launches holds global rank 0."""

import json
import os
import subprocess
import sys

import pytest

from eagle3_assets.lib.training.torchrun import torchrun_command
from eagle3_assets_tests.conftest import free_port

ENTRY = ["-m", "eagle3_assets.training_entry", "data/drafter/runs/abc/run.json"]


def test_one_node_is_standalone():
    assert torchrun_command(ENTRY, nproc=8, python="/venv/bin/python") == [
        "/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=8",
        *ENTRY,
    ]


def test_several_nodes_use_a_static_rendezvous_at_node_0():
    command = torchrun_command(
        ENTRY, nproc=8, nnodes=4, rdzv_endpoint="train-0.eagle3:29500", node_rank=2, python="py"
    )
    assert command == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes=4",
        "--node-rank=2",
        "--rdzv-backend=static",
        "--rdzv-endpoint=train-0.eagle3:29500",
        "--nproc-per-node=8",
        *ENTRY,
    ]
    assert "--standalone" not in command


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nnodes": 2}, "need a rendezvous endpoint 'host:port' on node 0, found None"),
        ({"nnodes": 2, "rdzv_endpoint": "train-0"}, "found 'train-0'"),
        ({"nnodes": 2, "rdzv_endpoint": "train-0:port"}, "found 'train-0:port'"),
        ({"nnodes": 2, "rdzv_endpoint": "h:1", "node_rank": 2}, "node_rank 2 is outside 0..1"),
        ({"nproc": 0}, "nproc and nnodes must be >= 1"),
    ],
)
def test_bad_settings_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        torchrun_command(ENTRY, **{"nproc": 1, **changes})


PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
record = {
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "sum": int(total),
    "launched_by_dagster": os.environ.get("PROBE_DAGSTER_NODE") == "1",
}
with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def test_two_nodes_rendezvous_and_the_launched_node_holds_rank_0(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # node 1 starts first: with c10d it could take rank 0 by host-name order; static cannot
    nodes = [
        subprocess.Popen(
            torchrun_command(
                [str(script), str(tmp_path)], 1, 2, endpoint, node_rank, sys.executable
            ),
            env={**env, "PROBE_DAGSTER_NODE": str(int(node_rank == 0))},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node_rank in (1, 0)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["group_rank"], r["world"], r["sum"]) for r in records] == [
        (0, 0, 2, 3),
        (1, 1, 2, 3),
    ]
    assert [r["launched_by_dagster"] for r in records] == [True, False]
