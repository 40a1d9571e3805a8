"""Cheap, bounded probes of a vLLM server, and the readiness state machine built on them.

A sensor tick must never hang or loop, so every request here has a short timeout and one
probe is a fixed handful of requests. The state machine is pure: it takes the previous
state and one probe and says what changed, so it is tested without a server or Dagster.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from packaging.version import InvalidVersion, Version
from prometheus_client.parser import text_string_to_metric_families

# The first vLLM release with everything the pipeline uses (requirements/serving-gpu.txt pins
# it): 0.25.0 is the first with DeepSeek/Kimi's final-layer capture (PR 46973).
MINIMUM_VLLM_VERSION = "0.25.0"
DRAFTS = "vllm:spec_decode_num_drafts_total"  # counters of a server with a drafter
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


class Reach(StrEnum):
    """What the transport saw, before any HTTP status is considered."""

    OK = "ok"
    REFUSED = "refused"  # nothing listens: vLLM is loading, or the process is gone
    TIMEOUT = "timeout"  # something listens but does not answer in time
    ERROR = "error"  # DNS, reset, malformed response...


@dataclass(frozen=True)
class Probe:
    """One look at a server: /health, then /v1/models, /version and /metrics if healthy."""

    base_url: str
    reach: Reach
    health_status: int | None = None
    model_ids: tuple[str, ...] = ()
    max_model_len: int | None = None
    version: str | None = None
    process_start_time: float | None = None
    drafts: float = 0.0  # speculative decoding since the start: drafts, and tokens accepted
    accepted: float = 0.0
    error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.reach is Reach.OK and self.health_status == 200

    @property
    def instance_id(self) -> str | None:
        """One server start (URL and process start time); keys its launch run. None when
        the server does not say when it started."""
        start = self.process_start_time
        return f"{self.base_url}@{start:.0f}" if start is not None else None


def version_problem(version: str | None) -> str | None:
    """Why a server reporting `version` cannot run the pipeline's steps, or None."""
    if version is None:
        return "it does not report its version at /version"
    try:
        found = Version(version).release
    except InvalidVersion:
        return f"its version {version!r} is not a release number"
    if found >= Version(MINIMUM_VLLM_VERSION).release:
        return None
    return (
        f"vLLM {version} is older than {MINIMUM_VLLM_VERSION}, the first release that captures "
        "a DeepSeek/Kimi target's final layer for EAGLE-3 (vLLM PR 46973): extraction would "
        "get one state fewer than the drafter reads, and evaluation and serving would feed "
        "the drafter the wrong layers; upgrade the serving venv (requirements/serving-gpu.txt)"
    )


def _get(url: str, timeout_s: float, api_key: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _classify(error: BaseException) -> Reach:
    reason = getattr(error, "reason", error)
    if isinstance(reason, ConnectionRefusedError):
        return Reach.REFUSED
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return Reach.TIMEOUT
    return Reach.ERROR


def probe(base_url: str, timeout_s: float = 2.0, api_key: str | None = None) -> Probe:
    """Probe one server; never raises for network trouble, reports it in the result."""
    base_url = base_url.rstrip("/")
    try:
        status, _ = _get(f"{base_url}/health", timeout_s, api_key)
        if status != 200:
            return Probe(base_url, Reach.OK, health_status=status)
        status, body = _get(f"{base_url}/v1/models", timeout_s, api_key)
        if status != 200:
            return Probe(
                base_url, Reach.OK, 200, error=f"/v1/models answered {status}: {body[:200]!r}"
            )
        models = json.loads(body).get("data", [])
        status, body = _get(f"{base_url}/version", timeout_s, api_key)
        version = json.loads(body).get("version") if status == 200 else None
        status, body = _get(f"{base_url}/metrics", timeout_s, api_key)
        metrics = parse_metrics(body.decode()) if status == 200 else {}
    except (urllib.error.URLError, OSError) as error:
        return Probe(base_url, _classify(error), error=f"{type(error).__name__}: {error}")
    except (ValueError, AttributeError) as error:
        return Probe(base_url, Reach.ERROR, 200, error=f"malformed response: {error}")
    start_times = metrics.get("process_start_time_seconds")
    return Probe(
        base_url,
        Reach.OK,
        health_status=200,
        model_ids=tuple(m["id"] for m in models),
        max_model_len=next((m.get("max_model_len") for m in models), None),
        version=version,
        process_start_time=next(iter(start_times.values())) if start_times else None,
        drafts=sum(metrics.get(DRAFTS, {}).values()),
        accepted=sum(metrics.get(ACCEPTED, {}).values()),
    )


Labels = tuple[tuple[str, str], ...]


def fetch_metrics(
    base_url: str, timeout_s: float = 5.0, api_key: str | None = None
) -> dict[str, dict[Labels, float]]:
    """The server's /metrics, parsed; counters are read as deltas around a workload."""
    status, body = _get(f"{base_url.rstrip('/')}/metrics", timeout_s, api_key)
    if status != 200:
        raise RuntimeError(f"{base_url}/metrics answered {status}: {body[:200]!r}")
    return parse_metrics(body.decode())


def smoke_chat(
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int = 32,
    timeout_s: float = 120.0,
    api_key: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict:
    """One greedy chat completion: proof the server generates, not only answers /health.
    `chat_template_kwargs` render the prompt as generation did (e.g. Kimi's thinking flag)."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if chat_template_kwargs is not None:
        payload["chat_template_kwargs"] = chat_template_kwargs
    started = time.monotonic()
    body = post_json(base_url, "/v1/chat/completions", payload, api_key, timeout_s)
    choice = body["choices"][0]
    return {
        "text": choice["message"].get("content") or "",
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "completion_tokens": body["usage"]["completion_tokens"],
        "latency_s": time.monotonic() - started,
    }


def post_json(
    base_url: str, path: str, payload: dict[str, Any], api_key: str | None, timeout_s: float
) -> dict:
    """POST `payload` to one of the server's endpoints; an HTTP error is raised naming the
    endpoint, its status and the start of the server's answer."""
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}{path}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(
            f"{base_url.rstrip('/')}{path} answered {error.code}: {error.read()[:300]!r}"
        ) from error


def parse_metrics(text: str) -> dict[str, dict[Labels, float]]:
    """Prometheus text format -> {sample name: {sorted label pairs: value}}, by prometheus_client's
    parser. Keyed by the sample's name, not the family's: a counter's samples keep their
    `_total` (vLLM's names are looked up with it), a histogram's their `_bucket`/`_sum`."""
    metrics: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            metrics.setdefault(sample.name, {})[labels] = float(sample.value)
    return metrics


class ServerState(StrEnum):
    LOADING = "loading"  # refused, and never seen ready since tracking began
    READY = "ready"  # healthy and serving the expected model
    WRONG_MODEL = "wrong_model"  # healthy, but the expected model is not listed
    UNRESPONSIVE = "unresponsive"  # accepts connections but does not answer in time
    DEAD = "dead"  # 5xx from /health, or refused after it had been ready


@dataclass(frozen=True)
class Readiness:
    """What the sensor remembers between ticks (its cursor) about one server."""

    state: ServerState = ServerState.LOADING
    seen_ready: bool = False
    loading_since: float | None = None  # first not-ready sighting, for the load deadline
    overdue: bool = False  # still loading past the deadline
    instance_id: str | None = None  # one server start; keys the launch run
    max_model_len: int | None = None
    version: str | None = None
    detail: str = ""
    ready_count: int = 0  # ready transitions seen: the instance id of last resort
    drafting: bool = False  # this instance's /metrics counted drafts: its drafter is in use
    acceptance_length: float | None = None  # 1 + accepted / drafts, when drafting began

    def to_json(self) -> dict:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_json(cls, data: dict) -> Readiness:
        return cls(**{**data, "state": ServerState(data["state"])})


def advance(
    previous: Readiness, seen: Probe, now: float, expected_model: str, load_deadline_s: float
) -> Readiness:
    """Fold one probe into the state; pure, so every edge is unit-testable."""
    state, detail = _state_of(previous, seen, expected_model)
    if state is ServerState.READY:
        # a new process start between two probes (a restart faster than a tick) is a new server
        restarted = seen.instance_id is not None and seen.instance_id != previous.instance_id
        drafting = bool(seen.drafts)
        acceptance = 1 + seen.accepted / seen.drafts if drafting else None
        if previous.state is ServerState.READY and not restarted:
            if drafting and not previous.drafting:  # the drafter's first drafts: confirmed
                return replace(previous, detail=detail, drafting=True, acceptance_length=acceptance)
            return replace(previous, detail=detail)
        count = previous.ready_count + 1
        return replace(
            previous,
            state=state,
            seen_ready=True,
            loading_since=None,
            overdue=False,
            instance_id=seen.instance_id or f"{seen.base_url}#{count}",
            max_model_len=seen.max_model_len,
            version=seen.version,
            detail=detail,
            ready_count=count,
            drafting=drafting,
            acceptance_length=acceptance,
        )
    waiting = state in (ServerState.LOADING, ServerState.UNRESPONSIVE) and not previous.seen_ready
    since = previous.loading_since if previous.loading_since is not None else now
    loading_since = since if waiting else None
    return replace(
        previous,
        state=state,
        loading_since=loading_since,
        overdue=waiting and now - loading_since > load_deadline_s,
        detail=detail,
    )


def worth_recording(previous: Readiness | None, current: Readiness) -> bool:
    """Observations mark the first sighting and changes (state, overrun, a new server start,
    its drafter's first drafts)."""
    return previous is None or (
        previous.state,
        previous.overdue,
        previous.instance_id,
        previous.drafting,
    ) != (current.state, current.overdue, current.instance_id, current.drafting)


def _state_of(previous: Readiness, seen: Probe, expected_model: str) -> tuple[ServerState, str]:
    if seen.reach is Reach.OK and seen.health_status is not None and seen.health_status >= 500:
        return ServerState.DEAD, f"/health answered {seen.health_status}"
    if seen.reach in (Reach.REFUSED, Reach.ERROR):
        if previous.seen_ready:
            return ServerState.DEAD, f"connection failed after it was ready: {seen.error}"
        return ServerState.LOADING, "not accepting connections yet"
    if seen.reach is Reach.TIMEOUT:
        return ServerState.UNRESPONSIVE, f"no answer in time: {seen.error}"
    if seen.health_status != 200:
        return ServerState.LOADING, f"/health answered {seen.health_status}"
    if seen.error:
        return ServerState.UNRESPONSIVE, seen.error
    if expected_model not in seen.model_ids:
        return ServerState.WRONG_MODEL, (
            f"serves {list(seen.model_ids)}, expected {expected_model!r}"
        )
    return ServerState.READY, f"serving {expected_model}"
