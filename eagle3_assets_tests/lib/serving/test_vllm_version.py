"""The vLLM release the pipeline needs: pinned for the GPU node, refused below it where a step
starts its own server (extraction, evaluation), both versions named."""

import re
from pathlib import Path

import pytest

from eagle3_assets.lib.evaluation.evaluate import BASELINE, Contender, evaluate
from eagle3_assets.lib.evaluation.settings import EvaluationSettings
from eagle3_assets.lib.hidden_states.backends import open_backend
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.serving.vllm_launcher import LaunchError, VLLMLaunchSpec, port_in_use
from eagle3_assets.lib.serving.vllm_probe import MINIMUM_VLLM_VERSION, version_problem
from eagle3_assets_tests.conftest import free_port
from eagle3_assets_tests.fault_server import stand_in_python

REPO = Path(__file__).resolve().parents[3]
REFUSED = "vLLM 0.24.1 is older than 0.25.0"


def test_the_minimum_is_what_the_gpu_venv_pins():
    pins = (REPO / "requirements" / "serving-gpu.txt").read_text()
    assert re.findall(r"^vllm>=(\S+)$", pins, re.MULTILINE) == [MINIMUM_VLLM_VERSION]


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("0.24.1", REFUSED),
        ("0.9.2", "vLLM 0.9.2 is older than 0.25.0"),
        ("0.25.0", None),
        ("0.25.0rc1", None),  # a candidate of the release: the capture is in it
        ("0.32.0+cpu", None),
        ("1.0.0", None),
        (None, "it does not report its version at /version"),
        ("0.0.fault", "its version '0.0.fault' is not a release number"),
    ],
)
def test_versions_below_the_minimum_are_refused(version, refused):
    problem = version_problem(version)
    assert (problem if problem is None else problem.split(",")[0]) == refused


@pytest.fixture
def old_vllm(tmp_path) -> Path:
    return stand_in_python(tmp_path / "python", "0.24.1")


def test_extraction_refuses_an_old_vllm(old_vllm, tmp_path):
    settings = HiddenStatesSettings(
        backend="vllm", device="cpu", serving_python=str(old_vllm), vllm_port=free_port()
    )
    backend = open_backend(settings, "cpu", "tiny", False, (1, 2, 4), 64, tmp_path / "server")
    with pytest.raises(LaunchError, match=REFUSED + ", the first release that captures"):
        backend.__enter__()  # where extraction waits for its server
    assert not port_in_use("127.0.0.1", settings.vllm_port)  # stopped once refused


def test_evaluation_refuses_an_old_vllm(old_vllm, tmp_path):
    spec = VLLMLaunchSpec("tiny-target", old_vllm, tmp_path / "server", port=free_port())
    prompts = {"held-out": [[{"role": "user", "content": "Say hi."}]]}
    with pytest.raises(LaunchError, match=REFUSED):
        evaluate(spec, [Contender(BASELINE, None)], prompts, EvaluationSettings(), tmp_path, None)
    assert not port_in_use("127.0.0.1", spec.port)
    assert list(tmp_path.glob("*.json")) == []  # nothing measured on it
