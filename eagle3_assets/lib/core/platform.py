"""Where extraction, training and evaluation run: the CPU or CUDA GPUs.

The user chooses (EAGLE3_PLATFORM); it is never guessed from the process that happens to ask,
whose torch may be a CPU build on a GPU node (the orchestration image) or whose venv is not
the one that runs the work (vLLM's). A `cuda` step checks the interpreter that will run it
before any work, and fails naming what that interpreter has.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

Platform = Literal["cpu", "cuda"]
DEFAULT_PLATFORM: Platform = "cpu"  # the demo and CI; a GPU node sets cuda

_PROBE = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, "
    "'cuda': torch.version.cuda, 'devices': torch.cuda.device_count()}))"
)


class PlatformError(RuntimeError):
    """A step asked for CUDA where its interpreter has none (or too few devices)."""


@dataclass(frozen=True)
class TorchBuild:
    python: str
    torch: str
    cuda: str | None  # torch.version.cuda: None for a CPU build
    devices: int

    @classmethod
    def here(cls) -> TorchBuild:
        import torch

        count = torch.cuda.device_count()
        return cls(sys.executable, torch.__version__, torch.version.cuda, count)

    def __str__(self) -> str:
        build = f"CUDA {self.cuda} build" if self.cuda else "CPU build"
        return f"{self.python} has torch {self.torch} ({build}) and sees {self.devices} GPUs"


def torch_build(python: str, step: str = "platform") -> TorchBuild:
    """What `python`'s torch is and sees, asked in a fresh process: the interpreter may be
    another venv's, and a CUDA context here would hold GPU memory the step needs."""
    try:
        found = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True
        )
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        message = f"{step}: {python}: cannot ask its torch what it sees ({detail})"
        raise PlatformError(message) from None
    return TorchBuild(python, **json.loads(found.stdout.strip().splitlines()[-1]))


def check_gpus(build: TorchBuild, devices: int, step: str) -> TorchBuild:
    """`build` when it sees `devices` GPUs for `step`, else PlatformError naming both."""
    if build.devices < devices:
        fix = "install a CUDA torch there" if build.cuda is None else "give it more GPUs"
        raise PlatformError(
            f"{step}: EAGLE3_PLATFORM=cuda needs {devices} GPU{'s' * (devices > 1)}, but "
            f"{build}; {fix}, or set EAGLE3_PLATFORM=cpu"
        )
    return build


def require(platform: Platform, python: str, devices: int, step: str) -> TorchBuild | None:
    """Before `step` starts on `python`: nothing to check on the CPU; on CUDA, its torch must
    see `devices` GPUs (torchrun ranks, tensor-parallel size)."""
    if platform == "cpu":
        return None
    return check_gpus(torch_build(python, step), devices, step)
