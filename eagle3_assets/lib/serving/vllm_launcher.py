"""Start and stop a vLLM OpenAI-compatible server as a process group we fully own.

Why so careful: vLLM spawns engine/GPU worker processes that outlive a killed API server
(vllm#55510), FlashInfer runs `ninja`/`nvcc` from PATH at run time (a nohup'd shell without
the venv on PATH fails an hour in), and a second server on a busy port dies late and
confusingly. So: absolute interpreter, explicit PATH, its own session, pid + log files,
SIGTERM then SIGKILL to the whole group, and a port check before anything starts.

A run dir belongs to one step at a time, so a live server found there at start is an orphan
of a killed attempt: reused when it is exactly the server asked for (launch.json records the
argv and the environment it was started with), stopped otherwise; never a refusal forever.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.lib.serving.vllm_probe import probe, version_problem

API_KEY_ENV = "VLLM_API_KEY"  # vLLM reads this itself; the key never appears on the argv


class LaunchError(RuntimeError):
    """A server could not be started, or did not become ready."""


@dataclass(frozen=True)
class VLLMLaunchSpec:
    """Everything that decides a vLLM server's command line and environment."""

    model: str
    python: Path  # the serving venv's interpreter; used as given, never resolved
    run_dir: Path  # holds server.pid, server.log, launch.json
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    dtype: str | None = None
    speculative_config: dict | None = None
    enforce_eager: bool = False
    trust_remote_code: bool = False
    engine_ready_timeout_s: int = 1800  # Kimi-K2.5 takes ~22 min; vLLM's default is 600
    cpu_kvcache_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE, CPU builds only
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "server.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "server.log"


def eagle3_speculative_config(drafter_dir: Path, num_speculative_tokens: int) -> dict:
    """vLLM's `--speculative-config` for serving the drafter in `drafter_dir` as EAGLE-3."""
    return {
        "method": "eagle3",
        "model": str(drafter_dir),
        "num_speculative_tokens": num_speculative_tokens,
    }


def with_eagle3_drafter(
    spec: VLLMLaunchSpec, drafter_dir: Path, num_speculative_tokens: int
) -> VLLMLaunchSpec:
    """`spec` serving the drafter in `drafter_dir` as its EAGLE-3 speculator."""
    speculative = eagle3_speculative_config(drafter_dir, num_speculative_tokens)
    return dataclasses.replace(spec, speculative_config=speculative)


def serve_line(
    model: str, drafter_dir: Path, num_speculative_tokens: int, trust_remote_code: bool = False
) -> str:
    """The `vllm serve` line a user runs to serve `model` with the drafter, as measured
    (with --trust-remote-code when the target's code was trusted for the measurement)."""
    speculative = json.dumps(eagle3_speculative_config(drafter_dir, num_speculative_tokens))
    line = ["vllm", "serve", model, "--speculative-config", speculative]
    if trust_remote_code:
        line.append("--trust-remote-code")
    return shlex.join(line)


def build_command(spec: VLLMLaunchSpec) -> list[str]:
    """The argv; `python -m` because vllm-cpu's `vllm` console script is broken."""
    python = Path(spec.python)
    if not python.is_absolute():
        python = Path.cwd() / python  # absolute, but not resolved: a venv's python is a symlink
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", spec.model, "--host", spec.host, "--port", str(spec.port)]
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    if spec.tensor_parallel_size != 1:
        cmd += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.max_model_len:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.dtype:
        cmd += ["--dtype", spec.dtype]
    if spec.speculative_config:
        cmd += ["--speculative-config", json.dumps(spec.speculative_config, sort_keys=True)]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(spec.extra_args)


def build_env(spec: VLLMLaunchSpec, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the venv's bin first on PATH, the load deadline raised."""
    env = dict(os.environ if base_env is None else base_env)
    venv_bin = str(Path(build_command(spec)[0]).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH") or "/usr/local/bin:/usr/bin:/bin"])
    env["VIRTUAL_ENV"] = str(Path(venv_bin).parent)
    env.pop("PYTHONPATH", None)  # the project's packages must not shadow vLLM's own
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(spec.engine_ready_timeout_s)
    if spec.cpu_kvcache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)
    env.update(spec.extra_env)
    return env


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a group, read from /proc so zombies do not count."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def group_alive(pgid: int) -> bool:
    if Path("/proc/self/stat").exists():
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _ignore(message: str) -> None:
    pass


def start(spec: VLLMLaunchSpec, log: Callable[[str], None] = _ignore) -> int:
    """Start the server in its own session and return its pid (= its process group id).

    A live server from `spec.run_dir` (an attempt killed while it ran) is reused when it was
    started exactly as `spec` says (its pid is returned; wait_ready follows it), and stopped
    otherwise; each is said through `log`."""
    previous = read_pid(spec.pid_file)
    if previous is not None and group_alive(previous):
        difference = _launch_difference(spec, previous)
        if difference is None:
            log(
                f"reusing the vLLM server (pid {previous}) a previous attempt left running "
                f"in {spec.run_dir}"
            )
            return previous
        log(
            f"stopping the vLLM server (pid {previous}) a previous attempt left running in "
            f"{spec.run_dir}: {difference}"
        )
        terminate_group(previous, grace_s=30.0)
        spec.pid_file.unlink(missing_ok=True)
    if port_in_use(spec.host, spec.port):
        raise LaunchError(
            f"port {spec.port} on {spec.host} is already in use by a process not started from "
            f"{spec.run_dir}; refusing to start a second server there (pick another --port or "
            f"stop whatever listens on it)"
        )
    cmd = build_command(spec)
    if not Path(cmd[0]).exists():
        raise LaunchError(f"serving interpreter not found: {cmd[0]} (create the serving venv)")
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    process = start_group(cmd, build_env(spec), spec.log_file, spec.run_dir)
    spec.pid_file.write_text(f"{process.pid}\n")
    record = {
        "pid": process.pid,
        "base_url": spec.base_url,
        **_fingerprint(spec),
        "spec": spec_to_json(spec),
    }
    (spec.run_dir / "launch.json").write_text(json.dumps(record, indent=2))
    return process.pid


def spec_to_json(spec: VLLMLaunchSpec) -> dict:
    """The spec as launch.json keeps it: `extra_env` by name only (a value may be a secret)."""
    record = {**dataclasses.asdict(spec), "python": str(spec.python), "run_dir": str(spec.run_dir)}
    record["extra_env"] = sorted(spec.extra_env)
    return record


def spec_from_json(data: dict) -> VLLMLaunchSpec:
    """The spec spec_to_json kept; LaunchError if it had extra environment variables, whose
    values were not kept."""
    if data["extra_env"]:
        raise LaunchError(
            f"the server in {data['run_dir']} was started with extra environment variables "
            f"({', '.join(data['extra_env'])}) whose values are not kept: restart it by hand"
        )
    paths = {"python": Path(data["python"]), "run_dir": Path(data["run_dir"])}
    return VLLMLaunchSpec(
        **{**data, **paths, "extra_args": tuple(data["extra_args"]), "extra_env": {}}
    )


def launched_spec(run_dir: Path) -> VLLMLaunchSpec:
    """How the server in `run_dir` was last started (launch.json): what a restart repeats."""
    try:
        record = json.loads((Path(run_dir) / "launch.json").read_text())
    except FileNotFoundError:
        raise LaunchError(
            f"{run_dir}: no launch.json: start the server with `python -m "
            "eagle3_assets.lib.serving.vllm_launcher start --run-dir ...` first"
        ) from None
    if "spec" not in record:
        raise LaunchError(f"{run_dir}/launch.json predates restarts: start the server again")
    return spec_from_json(record["spec"])


def _fingerprint(spec: VLLMLaunchSpec) -> dict:
    """What decides the server: its argv, and the environment the spec sets (hashed per
    variable: launch.json must not carry a value that may be a secret)."""
    env = build_env(spec, base_env={})
    return {
        "argv": build_command(spec),
        "env_sha256": {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in env.items()},
    }


def _launch_difference(spec: VLLMLaunchSpec, pid: int) -> str | None:
    """Why the live server `pid` in spec.run_dir is not the one `spec` describes, or None."""
    try:
        record = json.loads((spec.run_dir / "launch.json").read_text())
    except (FileNotFoundError, ValueError):
        record = {}
    if record.get("pid") != pid or "env_sha256" not in record:
        return "no launch.json records how it was started"
    wanted = _fingerprint(spec)
    if record["argv"] != wanted["argv"]:
        return (
            f"its command differs (was: {shlex.join(record['argv'])}; "
            f"now: {shlex.join(wanted['argv'])})"
        )
    env = record["env_sha256"]
    changed = sorted(
        k
        for k in env.keys() | wanted["env_sha256"].keys()
        if env.get(k) != wanted["env_sha256"].get(k)
    )
    if changed:
        return f"its environment differs in {', '.join(changed)}"
    return None


def stop(run_dir: Path, grace_s: float = 30.0) -> bool:
    """Stop the server started from run_dir; True if something was running."""
    pid_file = Path(run_dir) / "server.pid"
    pgid = read_pid(pid_file)
    running = pgid is not None and group_alive(pgid)
    if running:
        terminate_group(pgid, grace_s)
    pid_file.unlink(missing_ok=True)
    return running


def start_group(
    argv: list[str], env: dict[str, str], log_file: Path, cwd: Path
) -> subprocess.Popen:
    """`argv` in its own session (its pid is the group's id), output appended to `log_file`
    under a `=== <time> <command>` line: a process group we own and stop by signal
    (`terminate_group`)."""
    with open(log_file, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_stop_signals,
        )


def _default_stop_signals() -> None:
    """SIGINT and SIGTERM at their default actions in the child. A process started in the
    background (nohup, `cmd &`) ignores SIGINT, Dagster then gives SIGTERM SIGINT's handler
    (`setup_interrupt_handlers`), and ignored signals survive exec: the child would ignore the
    signal that stops it, and die only by SIGKILL once the grace is over. Only `signal.signal`
    runs here, between fork and exec."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def terminate_group(pgid: int, grace_s: float, first: signal.Signals = signal.SIGTERM) -> None:
    """`first` to the whole group, SIGKILL to the group after grace_s: nothing survives."""
    _signal_group(pgid, first)
    if not _wait_group_gone(pgid, grace_s):
        _signal_group(pgid, signal.SIGKILL)
        if not _wait_group_gone(pgid, 10.0):
            raise LaunchError(f"process group {pgid} survived SIGKILL")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone between the check and the signal
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pgid)
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return not group_alive(pgid)


def _reap(pid: int) -> None:
    """Collect our own exited child so it does not linger as a zombie in the group."""
    with contextlib.suppress(ChildProcessError):  # not our child: its parent reaps it
        os.waitpid(pid, os.WNOHANG)


def wait_ready(spec: VLLMLaunchSpec, timeout_s: float, poll_s: float = 1.0) -> float:
    """Block until /health is 200 and the model is listed; fail early if the server exits,
    and at once if its vLLM is older than the pipeline needs (every server started here
    extracts, evaluates or serves a drafter)."""
    started = time.monotonic()
    pgid = read_pid(spec.pid_file)
    model = spec.served_model_name or spec.model
    while time.monotonic() - started < timeout_s:
        status = probe(spec.base_url, timeout_s=2.0, api_key=os.environ.get(API_KEY_ENV))
        if status.healthy and model in status.model_ids:
            problem = version_problem(status.version)
            if problem is not None:
                raise LaunchError(f"{spec.base_url}: {problem}")
            return time.monotonic() - started
        if pgid is not None:
            _reap(pgid)
            if not group_alive(pgid):
                raise LaunchError(f"vLLM exited while loading; last log lines:\n{log_tail(spec)}")
        time.sleep(poll_s)
    raise LaunchError(f"vLLM not ready after {timeout_s:.0f}s; last log lines:\n{log_tail(spec)}")


def log_tail(spec: VLLMLaunchSpec, lines: int = 30) -> str:
    try:
        return "\n".join(spec.log_file.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _spec_from_args(args: argparse.Namespace) -> VLLMLaunchSpec:
    speculative = json.loads(args.speculative_config) if args.speculative_config else None
    if args.promoted:  # the promoted drafter, if any: what serving should use
        from eagle3_assets.lib.evaluation.promotion import Registry

        if (version := Registry(Path(args.promoted)).current()) is not None:
            speculative = eagle3_speculative_config(Path(version.path), args.speculative_tokens)
    return VLLMLaunchSpec(
        model=args.model,
        python=Path(args.python),
        run_dir=Path(args.run_dir),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        speculative_config=speculative,
        enforce_eager=args.enforce_eager,
        trust_remote_code=args.trust_remote_code,
        engine_ready_timeout_s=args.engine_ready_timeout_s,
        cpu_kvcache_gib=args.cpu_kvcache_gib,
        extra_args=tuple(args.extra or ()),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3-vllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    spec_default = {f.name: f.default for f in dataclasses.fields(VLLMLaunchSpec)}
    from eagle3_assets.lib.evaluation.settings import Decoding  # pydantic: only for the CLI

    tokens = Decoding.model_fields["num_speculative_tokens"].default
    for action in ("start", "command"):
        p = sub.add_parser(action, help=f"{action} a server's command line")
        p.add_argument("--model", required=True)
        p.add_argument("--python", required=True, help="the serving venv's bin/python")
        p.add_argument("--run-dir", default="data/vllm")
        p.add_argument("--host", default=spec_default["host"])
        p.add_argument("--port", type=int, default=spec_default["port"])
        p.add_argument("--served-model-name")
        p.add_argument(
            "--tensor-parallel-size", type=int, default=spec_default["tensor_parallel_size"]
        )
        p.add_argument("--max-model-len", type=int)
        p.add_argument("--dtype")
        p.add_argument("--speculative-config", help="JSON, as vLLM takes it")
        p.add_argument(
            "--promoted",
            help="the promotion folder on the data volume (data/promotion): serve its promoted "
            "drafter as eagle3 speculator, if one was promoted (overrides --speculative-config)",
        )
        p.add_argument("--speculative-tokens", type=int, default=tokens, help="with --promoted")
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--trust-remote-code", action="store_true")
        p.add_argument(
            "--engine-ready-timeout-s", type=int, default=spec_default["engine_ready_timeout_s"]
        )
        p.add_argument("--cpu-kvcache-gib", type=int)
        p.add_argument("--wait", type=float, default=0, help="seconds to wait for readiness")
        p.add_argument("extra", nargs="*", help="after --: passed to vLLM unchanged")
    p = sub.add_parser("stop", help="stop the server started from --run-dir")
    p.add_argument("--run-dir", default="data/vllm")
    p.add_argument("--grace-s", type=float, default=30.0)
    args = parser.parse_args(argv)

    if args.action == "stop":
        stopped = stop(Path(args.run_dir), args.grace_s)
        print("stopped" if stopped else "nothing running")
        return 0
    spec = _spec_from_args(args)
    if args.action == "command":
        print(shlex.join(build_command(spec)))
        return 0
    try:
        pid = start(spec, log=lambda message: print(message, flush=True))
        print(f"vLLM pid {pid} at {spec.base_url}; log: {spec.log_file}", flush=True)
        if args.wait:
            print(f"ready after {wait_ready(spec, args.wait):.0f}s")
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
