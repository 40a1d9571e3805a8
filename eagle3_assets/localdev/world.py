"""Build (or reuse) a miniature world: tokenizer, target-v1, target-v2 and the prompt pool.

It stands in for a big deployment offline and deterministically: the same spec gives the same
bytes. A world's family shapes its targets and tokenizer: "llama" (tiny Llama targets, a plain
tokenizer) or "kimi" (Kimi-K2-shaped DeepSeek-V3 targets, a remote-code tokenizer with Kimi's
chat template, prompts rendered in instant mode). A world is cached under <root>/<size> and
keyed by a hash of its spec, and it is built in a temporary directory renamed into place, so a
killed build never looks complete.

    python -m eagle3_assets.localdev.world --size demo --root data/world
"""

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.lib.core.atomic_files import held_alone
from eagle3_assets.localdev.prompts import topics
from eagle3_assets.localdev.tokenizer import CHAT_FORMATS, ChatFormat

BUILD_VERSION = 2  # bump when the build changes what it writes for the same spec


@dataclass(frozen=True)
class WorldSpec:
    """Everything that determines a world's bytes (besides the library versions)."""

    vocab_size: int
    hidden_size: int
    num_heads: int  # llama: head_dim = hidden_size // num_heads must be 32 or 64 for vLLM's CPU
    num_kv_heads: int  # kimi: equal to num_heads (MLA)
    intermediate_size: int  # kimi: the dense first layer's (the experts' is fixed)
    seq_len: int
    batch_size: int
    lr: float
    v1_steps: int
    v2_steps: int  # v2 continues from v1 on the other half of the data
    num_prompts: int  # pool plus held-out
    max_topic_chars: int | None = None  # keep only shorter topics: less to learn
    threads: int = 1  # torch threads; results are bit-identical only for the same count
    seed: int = 0
    family: str = "llama"  # a key of CHAT_FORMATS (tokenizer.py) and TARGET_CONFIGS (targets.py)

    def __post_init__(self) -> None:
        if self.family not in CHAT_FORMATS:
            raise ValueError(f"unknown family {self.family!r}; valid: {', '.join(CHAT_FORMATS)}")

    @property
    def chat(self) -> ChatFormat:
        return CHAT_FORMATS[self.family]

    @property
    def trust_remote_code(self) -> bool:
        """Whether loading the world's tokenizer (in transformers or vLLM) needs
        trust_remote_code: EAGLE3_TRUST_REMOTE_CODE and vLLM's --trust-remote-code."""
        return self.chat.remote_code

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None:
        """The rendering the targets were trained on, which generation must ask for
        (EAGLE3_CHAT_TEMPLATE_KWARGS); None: the template's defaults."""
        kwargs = self.chat.template_kwargs
        return None if kwargs is None else dict(kwargs)

    def topic_keys(self) -> tuple[str, ...]:
        """The topics this world's targets learn and its prompts ask about."""
        limit = self.max_topic_chars
        return tuple(key for key, text in topics().items() if limit is None or len(text) <= limit)

    def digest(self) -> str:
        """Hash of the spec, the build version and the topic corpus (it varies by Python)."""
        corpus = hashlib.sha256(json.dumps(topics(), sort_keys=True).encode()).hexdigest()
        spec = asdict(self)
        if self.family == "llama":
            del spec["family"]  # Llama worlds keep the hashes they had before families existed
        payload = {"spec": spec, "build_version": BUILD_VERSION, "corpus": corpus}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


SIZES: dict[str, WorldSpec] = {
    # Seconds on 2 cores, for tests: the 49 short topics, a 0.4M-parameter target.
    "test": WorldSpec(
        vocab_size=1024,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        seq_len=64,
        batch_size=8,
        lr=3e-3,
        v1_steps=200,
        v2_steps=300,
        num_prompts=70,
        max_topic_chars=2500,
    ),
    # A few minutes on 2 cores: all 79 topics, targets whose greedy output reads like text.
    "demo": WorldSpec(
        vocab_size=2048,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        seq_len=128,
        batch_size=8,
        lr=2e-3,
        v1_steps=300,
        v2_steps=450,
        num_prompts=500,
        threads=2,
    ),
    # Kimi-shaped (targets.kimi_config: a 5.5M-parameter DeepSeek-V3, ~10x the test Llama's
    # compute per token), for tests: the 33 topics of at most 1200 characters, learnt nearly by
    # heart so that greedy answers read like text (at lr 3e-3 they loop on quote marks).
    "kimi-test": WorldSpec(
        vocab_size=1024,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=512,
        seq_len=64,
        batch_size=8,
        lr=1e-3,
        v1_steps=300,
        v2_steps=300,
        num_prompts=70,
        max_topic_chars=1200,
        threads=2,
        family="kimi",
    ),
    # Kimi-shaped, for the demo: all 79 topics.
    "kimi-demo": WorldSpec(
        vocab_size=2048,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=512,
        seq_len=128,
        batch_size=8,
        lr=1e-3,
        v1_steps=300,
        v2_steps=450,
        num_prompts=500,
        threads=2,
        family="kimi",
    ),
}


@dataclass(frozen=True)
class World:
    """Paths of a built world; `root` is the world's own directory, <root>/<size>."""

    root: Path
    spec: WorldSpec
    tokenizer: Path
    target_v1: Path
    target_v2: Path
    prompts: Path
    heldout_prompts: Path

    @classmethod
    def at(cls, root: Path, spec: WorldSpec) -> "World":
        return cls(
            root=root,
            spec=spec,
            tokenizer=root / "tokenizer",
            target_v1=root / "target-v1",
            target_v2=root / "target-v2",
            prompts=root / "prompts.jsonl",
            heldout_prompts=root / "prompts-heldout.jsonl",
        )

    def is_complete(self) -> bool:
        """world.json is written last, so a matching hash means a finished build of this spec."""
        record = self.root / "world.json"
        return record.exists() and json.loads(record.read_text())["hash"] == self.spec.digest()


def build_world(root: Path, size: str = "test", log: Callable[[str], None] = print) -> World:
    """Return the world of `size` under `root`, building it first unless it is cached."""
    if size not in SIZES:
        raise ValueError(f"unknown world size {size!r}; valid sizes: {', '.join(SIZES)}")
    world = World.at(Path(root) / size, SIZES[size])
    with held_alone(world.root):  # parallel tests: one builds
        if world.is_complete():
            log(f"world {size!r} cached at {world.root}")
            return world
        staging = Path(tempfile.mkdtemp(prefix=f".{size}-building-", dir=world.root.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the world is shared with the servers
        try:
            started = time.perf_counter()
            record = _build(World.at(staging, world.spec), log)
            record["seconds"]["total"] = round(time.perf_counter() - started, 2)
            (staging / "world.json").write_text(json.dumps(record, indent=2) + "\n")
            shutil.rmtree(world.root, ignore_errors=True)  # a stale world of another spec
            staging.rename(world.root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    log(f"world {size!r} built at {world.root} in {record['seconds']['total']} s")
    return world


@contextmanager
def isolated_torch(threads: int) -> Iterator[None]:
    """Fix the thread count and fork the RNG so a build neither depends on nor changes the
    caller's torch state."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(before)


def _build(world: World, log: Callable[[str], None]) -> dict:
    """Build every part into `world.root`; return the record for world.json."""
    from transformers import AutoTokenizer

    from eagle3_assets.localdev import targets
    from eagle3_assets.localdev.prompts import write_prompt_pool
    from eagle3_assets.localdev.tokenizer import train_tokenizer

    spec = world.spec
    keys = spec.topic_keys()
    seconds: dict[str, float] = {}
    losses: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(part: str) -> None:
        nonlocal clock
        seconds[part] = round(time.perf_counter() - clock, 2)
        clock = time.perf_counter()

    with isolated_torch(spec.threads):
        log(f"tokenizer: byte-level BPE, vocab {spec.vocab_size}, {spec.family} chat format")
        train_tokenizer(list(topics().values()), spec.vocab_size, world.tokenizer, spec.chat)
        tokenizer = AutoTokenizer.from_pretrained(
            world.tokenizer, trust_remote_code=spec.trust_remote_code
        )
        lap("tokenizer")

        sequences = targets.training_sequences(
            tokenizer, spec.seq_len, keys, spec.chat_template_kwargs
        )
        first_half, second_half = targets.split_slices(sequences, spec.seed)
        config = targets.TARGET_CONFIGS[spec.family](
            tokenizer, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
        )
        model = targets.new_target(config, spec.seed)
        for name, data, steps, seed, path in (
            ("target-v1", first_half, spec.v1_steps, spec.seed, world.target_v1),
            ("target-v2", second_half, spec.v2_steps, spec.seed + 1, world.target_v2),
        ):
            log(f"{name}: {steps} steps on {len(data)} sequences of {len(keys)} topics")
            train_args = (data, steps, spec.batch_size, spec.lr, seed, log)
            losses[name] = round(targets.train(model, *train_args), 4)
            targets.save_target(model, world.tokenizer, path)
            lap(name)

        pool, heldout = write_prompt_pool(
            spec.num_prompts, keys, world.prompts, world.heldout_prompts
        )
        lap("prompts")

    specials = list(spec.chat.special_tokens)
    return {
        "hash": spec.digest(),
        "build_version": BUILD_VERSION,
        "spec": asdict(spec),
        "seconds": seconds,
        "final_loss": losses,
        "parameters_per_target": sum(p.numel() for p in model.parameters()),
        "special_token_ids": dict(
            zip(specials, tokenizer.convert_tokens_to_ids(specials), strict=True)
        ),
        "prompts": {"pool": pool, "heldout": heldout},
        "topics": len(keys),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="test", help=f"one of: {', '.join(SIZES)}")
    parser.add_argument("--root", type=Path, default=Path("data/world"))
    args = parser.parse_args()
    world = build_world(args.root, args.size)
    for name in ("tokenizer", "target_v1", "target_v2", "prompts", "heldout_prompts"):
        print(f"{name:>16}: {getattr(world, name)}")


if __name__ == "__main__":
    main()
