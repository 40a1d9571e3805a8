"""The generation client's own ceiling: requests/s against a zero-latency local server.

The client (run_batch: HTTP, JSON, part files, final Parquet) is pinned to one core and the
stub server to another, so the numbers say what one core of client can drive. `client CPU`
is the client's CPU time per wall second: near 100% means the client is the limit, and
`ceiling` (requests per client CPU second) is its throughput on one core. A served target
at 200 concurrent requests finishes a few requests per second; the ceiling must sit far above.

    .venv/bin/python benchmarks/client_ceiling.py        # about half a minute on 2 cores
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_assets.lib.generation.batch import run_batch
from eagle3_assets.lib.generation.conversations import Conversation
from eagle3_assets.lib.generation.settings import GenerationConfig

# (concurrency, requests, completion tokens per answer, return_token_ids)
CASES = [
    (1, 500, 16, False),
    (50, 3000, 16, False),
    (200, 4000, 16, False),
    (200, 1500, 1024, True),
]


def start_stub(completion_tokens: int, core: int) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "eagle3_assets_tests.openai_stub"]
    stub = subprocess.Popen(
        [*command, "--completion-tokens", str(completion_tokens)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    return stub, stub.stdout.readline().strip()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(concurrency: int, requests: int, tokens: int, token_ids: bool, stub_core: int) -> str:
    stub, url = start_stub(tokens, stub_core)
    try:
        prompts = [
            Conversation(f"p{i}", [{"role": "user", "content": f"question number {i}"}])
            for i in range(requests)
        ]
        config = GenerationConfig(
            max_tokens=tokens, concurrency=concurrency, return_token_ids=token_ids
        )
        with tempfile.TemporaryDirectory() as out_dir:
            stub_cpu, cpu, wall = cpu_seconds(stub.pid), time.process_time(), time.perf_counter()
            summary = run_batch(prompts, out_dir, [url], "stub", config)
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
            stub_cpu = cpu_seconds(stub.pid) - stub_cpu
    finally:
        stub.kill()
        stub.wait()
    assert summary.completed == requests and summary.final_path is not None
    return (
        f"| {concurrency:>11} | {tokens:>6} | {'yes' if token_ids else 'no':>9} | {requests:>8} "
        f"| {requests / wall:>7.0f} | {summary.output_tokens_per_s:>10.0f} "
        f"| {cpu / wall:>9.0%} | {stub_cpu / wall:>7.0%} | {requests / cpu:>16.0f} |"
    )


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    client_core, stub_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {client_core})
    print(f"client on core {client_core}, stub server on core {stub_core}\n")
    print(
        "| concurrency | tokens | token ids | requests |   req/s | out tok/s "
        "| client CPU | stub CPU | ceiling req/s/core |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in CASES:
        print(measure(*case, stub_core=stub_core), flush=True)


if __name__ == "__main__":
    main()
