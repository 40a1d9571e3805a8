"""EAGLE3_PLATFORM: a step asked to run on CUDA checks the interpreter that will run it before
any work and fails naming what that interpreter has; the CPU (the demo's) asks nothing.

The tests ask for one GPU more than this machine's torch sees, so they hold on any machine."""

import sys
from pathlib import Path

import dagster as dg
import pytest
import torch

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.evaluation.assets import drafter_evaluation
from eagle3_assets.defs.training.assets import eagle3_drafter
from eagle3_assets.lib.core.platform import PlatformError, TorchBuild, require, torch_build
from eagle3_assets.lib.hidden_states.backends import open_backend
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.training.train_drafter import RunConfig, train

REPO = Path(__file__).resolve().parents[3]
HERE = TorchBuild.here()
TOO_MANY = HERE.devices + 1


def test_the_probe_reads_the_interpreters_own_torch():
    assert torch_build(sys.executable) == HERE
    assert (HERE.torch, HERE.cuda, HERE.devices) == (
        torch.__version__,
        torch.version.cuda,
        torch.cuda.device_count(),
    )


def test_cuda_without_enough_gpus_names_the_interpreter_and_what_it_has():
    with pytest.raises(PlatformError) as raised:
        require("cuda", sys.executable, TOO_MANY, "training")
    build = f"CUDA {HERE.cuda} build" if HERE.cuda else "CPU build"
    fix = "give it more GPUs" if HERE.cuda else "install a CUDA torch there"
    assert str(raised.value) == (
        f"training: EAGLE3_PLATFORM=cuda needs {TOO_MANY} GPU{'s' * (TOO_MANY > 1)}, but "
        f"{sys.executable} has torch {HERE.torch} ({build}) and sees {HERE.devices} GPUs; "
        f"{fix}, or set EAGLE3_PLATFORM=cpu"
    )


def test_the_cpu_asks_nothing_and_a_missing_interpreter_is_named():
    assert require("cpu", "/nowhere/bin/python", 8, "training") is None
    with pytest.raises(PlatformError, match="evaluation: /nowhere/bin/python: cannot ask its"):
        require("cuda", "/nowhere/bin/python", 1, "evaluation")


def test_a_training_rank_without_its_gpu_fails_before_reading_anything(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", str(HERE.devices))  # needs one GPU more than there are
    run = RunConfig(
        batch_dirs=[], warm_start=None, target="", out_dir=str(tmp_path), steps=1, platform="cuda"
    )
    with pytest.raises(PlatformError, match=f"training rank {HERE.devices}: EAGLE3_PLATFORM=cuda"):
        train(run)
    assert list(tmp_path.iterdir()) == []


def test_extraction_on_cuda_is_refused_before_the_target_loads(tmp_path):
    settings = HiddenStatesSettings(backend="vllm", serving_python=sys.executable)
    settings = settings.model_copy(update={"vllm_tensor_parallel_size": TOO_MANY})
    with pytest.raises(PlatformError, match=r"extraction \(vllm\): EAGLE3_PLATFORM=cuda needs"):
        open_backend(settings, "cuda", "no-target", False, (1, 2), 64, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no server was started


def kimi_settings() -> dict[str, str]:
    """deploy/kimi-k2.5.env, the production settings, as `set -a; . file` exports them."""
    lines = (REPO / "deploy" / "kimi-k2.5.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


@pytest.mark.parametrize(
    ("asset", "step", "gpus"),
    [
        (eagle3_drafter, "training", "EAGLE3_TRAIN_NPROC"),
        (drafter_evaluation, "evaluation", "EAGLE3_EVAL_TP"),
    ],
)
def test_the_production_settings_on_this_machine_fail_at_the_first_step(
    asset, step, gpus, tmp_path
):
    env = kimi_settings()
    assert (env["EAGLE3_PLATFORM"], env[gpus]) == ("cuda", "8")
    env |= {  # this machine's venv for the serving one, which it lacks (named, below)
        "EAGLE3_DATA_ROOT": str(tmp_path / "data"),
        "EAGLE3_SERVING_PYTHON": sys.executable,
        gpus: str(max(8, TOO_MANY)),
    }
    result = dg.materialize(
        [asset],
        resources=resources_from_env(env),
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.error.message
    assert f"{step}: EAGLE3_PLATFORM=cuda needs {max(8, TOO_MANY)} GPUs, but" in message, message
    assert not (tmp_path / "data").exists()  # nothing written


def test_the_platform_is_a_named_setting():
    assert resources_from_env({})["compute"].platform == "cpu"
    with pytest.raises(ValueError, match="EAGLE3_PLATFORM: expected 'cpu' or 'cuda', found 'tpu'"):
        resources_from_env({"EAGLE3_PLATFORM": "tpu"})
