"""Drafter training on CPU: what a step costs, in the miniature and at Kimi-K2's width.

1. Miniature end to end, the code path the training asset runs: the demo world's target-v2
   writes 64 greedy answers (96 new tokens at most), their hidden states are extracted
   (bf16 aux + bf16 final, the vLLM default aux layers), and `train()` runs an untrained
   drafter (draft vocab 1024) for 30 steps, batch 4, TTT length 7, in a fresh process.
   Reported: tokens/s over the whole run and over the steps after the first 2 (warm-up:
   allocator, first shapes), seconds per step, and the process's peak RSS (ru_maxrss).
2. One training step (forward + backward, no optimizer) of a Kimi-K2-shaped drafter layer
   through `Eagle3Drafter.ttt` and the real `ttt_loss`, on synthetic aux states and teacher
   probabilities, fp32 on 2 threads: wall seconds, RSS growth (gradients + activations over
   the resident weights, sampled from /proc), FLOPs and achieved GFLOP/s, for sequence
   lengths 32/64/128 at TTT 1 and TTT 1/3/7 at length 64. The shape is assumed from
   Kimi-K2 (H 7168) and a Llama-style drafter layer, not read from a published checkpoint.
3. GPU throughput and MFU are not measured (no GPU was lent to this task).

Each measured part runs in a child process of this script, so its peak RSS is its own.

    .venv/bin/python benchmarks/drafter_training.py           # several minutes, ~9 GB RAM
    .venv/bin/python benchmarks/drafter_training.py --quick   # code path only, < 1 min
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_assets.lib.training.eagle3_model import DrafterConfig, Eagle3Drafter
from eagle3_assets.lib.training.ttt import Batch, ttt_loss

REPO = Path(__file__).resolve().parents[1]
THREADS = 2
WARMUP_STEPS = 2  # training steps left out of the steady-state rate
STANDIN_VOCAB = 4096  # embedding rows actually allocated; the ttt only gathers rows

# Kimi-K2: H 7168, vocab 163840. The drafter layer's attention and MLP shapes are assumptions
# (56 x 128 query heads = H, 8 KV heads, Kimi's dense intermediate 18432), draft vocab 32000.
KIMI_LAYER = DrafterConfig(
    hidden_size=7168,
    num_attention_heads=56,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=18432,
    vocab_size=163840,
    draft_vocab_size=32000,
)
QUICK_LAYER = DrafterConfig(
    hidden_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=2816,
    vocab_size=32000,
    draft_vocab_size=8000,
)


@dataclass(frozen=True)
class Plan:
    """What one run measures; `--quick` shrinks every part to validate the code path."""

    rows: int
    max_new_tokens: int
    steps: int
    layer: DrafterConfig
    lengths: tuple[int, ...]  # at TTT 1
    ttt_lengths: tuple[int, ...]  # at `ttt_at`
    ttt_at: int

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(S, TTT) pairs, each measured once."""
        shapes = [(s, 1) for s in self.lengths]
        return shapes + [
            (self.ttt_at, t) for t in self.ttt_lengths if (self.ttt_at, t) not in shapes
        ]


FULL = Plan(64, 96, 30, KIMI_LAYER, (32, 64, 128), (1, 3, 7), 64)
QUICK = Plan(16, 48, 5, QUICK_LAYER, (16, 32), (1, 3), 32)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_memory() -> None:
    """Hand freed heap back to the OS (glibc's malloc_trim), so that RSS before a step is
    what is live, not what an earlier step freed and malloc kept."""
    gc.collect()
    with suppress(OSError, AttributeError):  # not glibc: RSS may include freed memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextmanager
def sampled_rss_peak(interval: float = 0.005) -> Iterator[dict[str, int]]:
    """The highest RSS seen while the block runs. ru_maxrss only ever rises, so it cannot
    give one step's peak after an earlier, larger one; a sampler thread can (torch releases
    the GIL inside its kernels). Short spikes between samples may be missed."""
    seen = {"peak": current_rss_bytes()}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen["peak"] = max(seen["peak"], current_rss_bytes())
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()
        seen["peak"] = max(seen["peak"], current_rss_bytes())


# --- part 1: miniature training, end to end ------------------------------------------------


def prepare_miniature(plan: Plan, work: Path) -> tuple[Path, Path, Path, dict]:
    """(hidden-states dir, untrained drafter dir, target dir, data stats): the inputs a
    training run reads, made the way the training asset makes them."""
    from transformers import AutoTokenizer

    from eagle3_assets.lib.core.layer_ids import default_aux_layers
    from eagle3_assets.lib.hidden_states.extract import (
        ExtractionSettings,
        LayerSelection,
        extract_batch,
    )
    from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
    from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
    from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
    from eagle3_assets.localdev.greedy import greedy_generation_rows
    from eagle3_assets.localdev.hub import make_untrained_drafter
    from eagle3_assets.localdev.world import build_world

    world = build_world(REPO / "data" / "world", "demo", log=lambda m: print(m, file=sys.stderr))
    target = world.target_v2
    config = json.loads((target / "config.json").read_text())
    layers = LayerSelection(
        default_aux_layers(config["num_hidden_layers"]), config["num_hidden_layers"], "default"
    )
    started = time.perf_counter()
    rows = greedy_generation_rows(target, world.prompts, plan.rows, plan.max_new_tokens)
    generation_s = time.perf_counter() - started
    sequences = build_sequences(rows, AutoTokenizer.from_pretrained(target))
    hidden_states = work / "hidden_states"
    summary = extract_batch(
        sequences,
        hidden_states,
        lambda: HFTarget(target, layers.ids, dtype="float32", device="cpu"),
        layers,
        config["hidden_size"],
        ExtractionSettings(ShardFormat("bf16", "bf16")),
        {"target": "target-v2"},
    )
    drafter = make_untrained_drafter(target, work / "drafter", 1024, seed=0)
    stats = {
        "samples": summary.samples,
        "tokens": summary.tokens,
        "teacher_positions": summary.teacher_positions,
        "generation_s": generation_s,
        "extraction_s": summary.seconds,
        "aux_layers": list(layers.aux),
    }
    return hidden_states, drafter, target, stats


def train_child(spec: dict) -> dict:
    """In the child: one `train()` run; its history, timings and peak RSS."""
    from eagle3_assets.lib.training.train_drafter import RunConfig, train

    torch.set_num_threads(THREADS)
    before = peak_rss_bytes()
    result = train(RunConfig(**spec))
    return {
        "tokens": result.tokens,
        "seconds": result.seconds,
        "history": [
            {k: m[k] for k in ("step", "loss", "tokens", "tokens_per_s")} for m in result.history
        ],
        "rss_before_train": before,
        "peak_rss": peak_rss_bytes(),
    }


def steady_state(history: list[dict], skip: int) -> dict[str, float] | None:
    """Tokens/s and s/step after the first `skip` steps. The history holds cumulative tokens
    and tokens/s since the start, so step i ended tokens_i / tokens_per_s_i seconds in."""
    if len(history) <= skip:
        return None
    ended = [m["tokens"] / m["tokens_per_s"] for m in history]
    first = ended[skip - 1] if skip else 0.0
    first_tokens = history[skip - 1]["tokens"] if skip else 0
    seconds = ended[-1] - first
    return {
        "tokens_per_s": (history[-1]["tokens"] - first_tokens) / seconds,
        "s_per_step": seconds / (len(history) - skip),
        "warmup_s": first,
    }


def miniature_training(plan: Plan, work: Path) -> dict:
    hidden_states, drafter, target, stats = prepare_miniature(plan, work)
    spec = {
        "batch_dirs": [str(hidden_states)],
        "warm_start": str(drafter),
        "target": str(target),
        "out_dir": str(work / "run"),
        "steps": plan.steps,
        "batch_size": 4,
        "ttt_length": 7,
        "lr": 3e-3,  # from scratch, as the world's drafter is trained
        "warmup_ratio": 0.05,
        "checkpoint_every": plan.steps + 1,  # only the final checkpoint: not in the step times
    }
    return {"data": stats, "spec": spec, "run": run_child("train", spec)}


# --- part 2: one step of a Kimi-shaped drafter layer -----------------------------------------


def synthetic_batch(config: DrafterConfig, length: int, ttt: int, seed: int) -> Batch:
    """One sample of random aux states, token ids below STANDIN_VOCAB and teacher
    probabilities over the draft vocab, every position supervised."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(1, length + ttt, config.draft_vocab_size, generator=generator)
    return Batch(
        aux=torch.randn(1, length, config.aux_width, generator=generator),
        input_ids=torch.randint(0, STANDIN_VOCAB, (1, length + ttt - 1), generator=generator),
        key_mask=torch.ones(1, length, dtype=torch.bool),
        targets=teacher.softmax(-1),
        supervised=torch.ones(1, length + ttt, dtype=torch.bool),
    )


def step_flops(config: DrafterConfig, fc: int, rest: int, length: int, ttt: int) -> float:
    """Matmul FLOPs of forward + backward. fc runs once per step and its input needs no
    gradient (4 x params x S); the layer, norm and lm_head run once per TTT step (6 x params
    x S x TTT). Attention at TTT step k: an S x S score matrix plus S x k chain scores, for
    QK and for PV, forward 4 S (S + k) heads head_dim and backward twice that."""
    heads_dim = config.num_attention_heads * config.head_dim
    attention = sum(12 * length * (length + k) * heads_dim for k in range(ttt))
    return 4.0 * fc * length + 6.0 * rest * length * ttt + attention


def layer_child(spec: dict) -> dict:
    """In the child: build the layer, one warm-up step, then one timed step per shape."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    config = DrafterConfig(**spec["config"])
    # The frozen embedding is only gathered from: STANDIN_VOCAB rows cost the same per token as
    # the full vocab (which would be vocab x H x 4 B resident, 4.7 GB for Kimi) and ids stay
    # below it. t2d (sized by the vocab) is not read by the TTT.
    standin = dataclasses.replace(config, vocab_size=STANDIN_VOCAB)
    started = time.perf_counter()
    model = Eagle3Drafter(standin, torch.randn(STANDIN_VOCAB, config.hidden_size) * 0.02)
    build_s = time.perf_counter() - started
    fc = model.fc.weight.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shapes = [tuple(s) for s in spec["shapes"]]

    def step(length: int, ttt: int) -> dict:
        batch = synthetic_batch(config, length, ttt, seed=length * 31 + ttt)
        model.zero_grad(set_to_none=True)  # gradients are allocated inside the step
        release_free_memory()
        resident = current_rss_bytes()
        with sampled_rss_peak() as rss:
            started = time.perf_counter()
            loss, *_ = ttt_loss(model, batch, ttt, decay=0.8)
            loss.backward()
            seconds = time.perf_counter() - started
        return {"seconds": seconds, "rss_growth": rss["peak"] - resident, "resident": resident}

    step(*shapes[0])  # warm-up
    rows = []
    for length, ttt in shapes:
        measured = step(length, ttt)
        flops = step_flops(config, fc, trainable - fc, length, ttt)
        rows.append({"length": length, "ttt": ttt, "flops": flops, **measured})
    return {
        "trainable": trainable,
        "fc": fc,
        "lm_head": model.lm_head.weight.numel(),
        "build_s": build_s,
        "rows": rows,
        "peak_rss": peak_rss_bytes(),
    }


# --- running and reporting ----------------------------------------------------------------


def run_child(kind: str, spec: dict) -> dict:
    """Run `kind` in a fresh process of this script; its last stdout line is the result."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB"


def mb(size: float) -> str:
    return f"{size / 1e6:,.0f} MB"


def report(plan: Plan, mini: dict, layer: dict, quick: bool) -> str:
    data, spec, run = mini["data"], mini["spec"], mini["run"]
    steady = steady_state(run["history"], WARMUP_STEPS)
    history = run["history"]
    lines = [
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{THREADS} threads, fp32."
        + (" **--quick: shrunken sizes, not results.**" if quick else ""),
        "",
        "### Miniature drafter training (demo target-v2, CPU)",
        "",
        f"Data: {data['samples']} greedy answers (max {plan.max_new_tokens} new tokens), "
        f"{data['tokens']:,} tokens, {data['teacher_positions']:,} teacher positions; "
        f"generated in {data['generation_s']:.1f} s, hidden states (bf16+bf16, aux layers "
        f"{data['aux_layers']}) extracted in {data['extraction_s']:.1f} s. Untrained drafter, "
        f"draft vocab 1024; `train()` {spec['steps']} steps, batch {spec['batch_size']}, "
        f"TTT {spec['ttt_length']}, in its own process.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| tokens trained | {run['tokens']:,} |",
        f"| tokens/s, whole run (`train()` seconds, final checkpoint and export included) "
        f"| {run['tokens'] / run['seconds']:,.0f} ({run['seconds']:.1f} s) |",
    ]
    if steady is not None:
        lines += [
            f"| tokens/s, steps {WARMUP_STEPS + 1}-{len(history)} | "
            f"{steady['tokens_per_s']:,.0f} |",
            f"| s/step, steps {WARMUP_STEPS + 1}-{len(history)} | {steady['s_per_step']:.3f} |",
            f"| first {WARMUP_STEPS} steps | {steady['warmup_s']:.2f} s |",
        ]
    lines += [
        f"| peak RSS of the training process | {mb(run['peak_rss'])} |",
        f"| peak RSS before `train()` (imports) | {mb(run['rss_before_train'])} |",
        f"| loss, step 1 -> {len(history)} | {history[0]['loss']:.3f} -> "
        f"{history[-1]['loss']:.3f} |",
        "",
    ]
    config = plan.layer
    name = "quick stand-in" if quick else "Kimi-K2-shaped"
    lines += [
        f"### One training step of a {name} drafter layer (forward + backward, no optimizer)",
        "",
        f"Config: hidden {config.hidden_size}, {config.num_attention_heads} query heads x "
        f"{config.head_dim}, {config.num_key_value_heads} KV heads, intermediate "
        f"{config.intermediate_size}, target vocab {config.vocab_size:,}, draft vocab "
        f"{config.draft_vocab_size:,}, aux {config.num_aux_hidden_states} x "
        f"{config.hidden_size}; attention/MLP shapes assumed, not read from a checkpoint. "
        f"Trainable parameters: {layer['trainable']:,} (fc {layer['fc']:,}, lm_head "
        f"{layer['lm_head']:,}); fp32 weights {gb(4 * layer['trainable'])}, gradients as much. "
        f"The frozen embedding is a stand-in of {STANDIN_VOCAB} rows with token ids below it "
        f"(the TTT only gathers rows: the same cost per token as {config.vocab_size:,} rows, "
        f"which would hold {gb(4 * config.vocab_size * config.hidden_size)} of RAM). "
        "Synthetic aux states and teacher probabilities, batch 1, the real `ttt_loss` "
        "(decay 0.8), one warm-up step first, then one timed step per row.",
        "",
        "FLOPs: 4 x fc params x S + 6 x (other params) x S x TTT + attention "
        "(12 S (S + k) heads head_dim at TTT step k).",
        "",
        "| S | TTT | wall s | RSS growth (grads + activations) | GFLOP | GFLOP/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in layer["rows"]:
        lines.append(
            f"| {row['length']} | {row['ttt']} | {row['seconds']:.2f} | "
            f"{mb(row['rss_growth'])} | {row['flops'] / 1e9:,.0f} | "
            f"{row['flops'] / 1e9 / row['seconds']:,.1f} |"
        )
    lines += [
        "",
        f"Layer built in {layer['build_s']:.1f} s; peak RSS of that process "
        f"{gb(layer['peak_rss'])}, resident before the first timed step "
        f"{gb(layer['rows'][0]['resident'])}.",
        "",
        "### GPU",
        "",
        "No GPU was available (the H200 device machine was not lent to this task), so GPU "
        "throughput and MFU are not measured.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shrunken sizes, < 1 min")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # a measured part, in its own process
        kind, spec = args.child[0], json.loads(args.child[1])
        print(json.dumps({"train": train_child, "layer": layer_child}[kind](spec)))
        return
    torch.set_num_threads(THREADS)
    plan = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="drafter-training-bench-") as scratch:
        mini = miniature_training(plan, Path(scratch))
    layer = run_child(
        "layer", {"config": dataclasses.asdict(plan.layer), "shapes": plan.layer_shapes()}
    )
    print(report(plan, mini, layer, args.quick))


if __name__ == "__main__":
    main()
