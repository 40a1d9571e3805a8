import pytest

from eagle3_assets.lib.serving.vllm_probe import (
    Probe,
    Reach,
    Readiness,
    ServerState,
    advance,
    parse_metrics,
    probe,
    smoke_chat,
    worth_recording,
)
from eagle3_assets_tests.fault_server import FaultServer, closed_port_url
from eagle3_assets_tests.openai_stub import OpenAIStub

MODEL = "tiny-target"


@pytest.fixture
def server():
    with FaultServer() as s:
        yield s


def test_probe_reads_models_version_and_start_time(server):
    seen = probe(server.base_url)
    assert seen.healthy
    assert seen.model_ids == (MODEL,)
    assert seen.max_model_len == 512
    assert seen.version == "0.0.fault"
    assert seen.process_start_time == 1_700_000_000.0
    assert server.behaviour.requests == ["/health", "/v1/models", "/version", "/metrics"]


def test_probe_stops_at_unhealthy(server):
    server.behaviour.health_status = 503
    seen = probe(server.base_url)
    assert (seen.reach, seen.health_status, seen.healthy) == (Reach.OK, 503, False)
    assert server.behaviour.requests == ["/health"]


def test_probe_reports_refused_and_timeout(server):
    assert probe(closed_port_url()).reach is Reach.REFUSED
    server.behaviour.delay_s = 1.0
    seen = probe(server.base_url, timeout_s=0.2)
    assert seen.reach is Reach.TIMEOUT
    assert "timed out" in seen.error


def test_probe_reports_models_endpoint_failure(server):
    server.behaviour.models_status = 500
    seen = probe(server.base_url)
    assert seen.health_status == 200 and seen.model_ids == ()
    assert "/v1/models answered 500" in seen.error


def test_parse_metrics_labels_and_escapes():
    text = (
        "# HELP vllm:spec_decode_num_drafts_total drafts\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 12.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a \\"q\\"",'
        'position="1"} 7\n'
        "process_start_time_seconds 1.7e9\n"
    )
    metrics = parse_metrics(text)
    # a counter is found under its full name, `_total` included, as vLLM names it
    assert metrics["vllm:spec_decode_num_drafts_total"] == {
        (("engine", "0"), ("model_name", "m")): 12.0
    }
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos == {(("model_name", 'a "q"'), ("position", "1")): 7.0}
    assert metrics["process_start_time_seconds"] == {(): 1.7e9}


def test_parse_metrics_reads_timestamps_histograms_and_labels_with_commas():
    text = (
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="m"} 96 1700000000000\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} 2\n'
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 3\n'
        'vllm:e2e_request_latency_seconds_sum{model_name="m"} 2.5\n'
        'vllm:e2e_request_latency_seconds_count{model_name="m"} 3\n'
        'vllm:cache_config_info{block_size="16",note="a, b=\\"c\\""} 1\n'
    )
    metrics = parse_metrics(text)
    assert metrics["vllm:generation_tokens_total"] == {(("model_name", "m"),): 96.0}
    buckets = metrics["vllm:e2e_request_latency_seconds_bucket"]
    assert buckets[(("le", "+Inf"), ("model_name", "m"))] == 3.0
    assert metrics["vllm:e2e_request_latency_seconds_count"] == {(("model_name", "m"),): 3.0}
    assert metrics["vllm:cache_config_info"] == {(("block_size", "16"), ("note", 'a, b="c"')): 1.0}


def test_smoke_chat_renders_with_the_template_kwargs_given():
    with OpenAIStub() as stub:
        smoke_chat(stub.base_url, MODEL, [{"role": "user", "content": "hi"}], 4)
        assert "chat_template_kwargs" not in stub.last_payload  # the server's defaults
        answer = smoke_chat(
            stub.base_url,
            MODEL,
            [{"role": "user", "content": "hi"}],
            4,
            chat_template_kwargs={"thinking": False},
        )
        assert stub.last_payload["chat_template_kwargs"] == {"thinking": False}
        assert answer["completion_tokens"] == 4


def ready_probe(url="http://s:1", start=100.0, models=(MODEL,), drafts=0.0, accepted=0.0) -> Probe:
    return Probe(url, Reach.OK, 200, models, 512, "0.32.0", start, drafts, accepted)


REFUSED = Probe("http://s:1", Reach.REFUSED, error="refused")


def step(previous, seen, now, deadline=60.0):
    return advance(previous, seen, now, MODEL, deadline)


def test_loading_then_ready_then_dead():
    loading = step(Readiness(), REFUSED, now=0.0)
    assert (loading.state, loading.loading_since, loading.overdue) == (
        ServerState.LOADING,
        0.0,
        False,
    )
    ready = step(loading, ready_probe(), now=30.0)
    assert ready.state is ServerState.READY and ready.seen_ready
    assert ready.instance_id == "http://s:1@100"
    assert (ready.max_model_len, ready.version, ready.loading_since) == (512, "0.32.0", None)
    assert worth_recording(loading, ready)
    again = step(ready, ready_probe(), now=40.0)
    assert not worth_recording(ready, again)
    dead = step(again, REFUSED, now=50.0)
    assert dead.state is ServerState.DEAD and "after it was ready" in dead.detail
    assert worth_recording(again, dead)


def test_5xx_is_dead_even_before_ready():
    seen = Probe("http://s:1", Reach.OK, 503)
    assert step(Readiness(), seen, 0.0).state is ServerState.DEAD


def test_deadline_overrun_is_flagged_once_and_keeps_first_sighting():
    first = step(Readiness(), REFUSED, now=0.0)
    late = step(first, REFUSED, now=61.0)
    assert late.overdue and late.loading_since == 0.0
    assert worth_recording(first, late)
    later = step(late, REFUSED, now=90.0)
    assert later.overdue and not worth_recording(late, later)


def test_wrong_model_and_timeout_states():
    wrong = step(Readiness(), ready_probe(models=("other",)), 0.0)
    assert wrong.state is ServerState.WRONG_MODEL and "expected 'tiny-target'" in wrong.detail
    stalled = Probe("http://s:1", Reach.TIMEOUT, error="timed out")
    assert step(wrong, stalled, 1.0).state is ServerState.UNRESPONSIVE


def test_restart_is_a_new_instance():
    ready = step(step(Readiness(), REFUSED, 0.0), ready_probe(start=100.0), 1.0)
    dead = step(ready, REFUSED, 2.0)
    back = step(dead, ready_probe(start=200.0), 3.0)
    assert back.state is ServerState.READY
    assert back.instance_id == "http://s:1@200" != ready.instance_id


def test_a_restart_between_two_probes_is_a_new_instance():
    """Restarted faster than a tick: never seen down, but a new process start time."""
    ready = step(Readiness(), ready_probe(start=100.0), 0.0)
    back = step(ready, ready_probe(start=200.0), 10.0)
    assert (back.state, back.instance_id, back.ready_count) == (
        ServerState.READY,
        "http://s:1@200",
        2,
    )
    assert worth_recording(ready, back)
    assert step(back, ready_probe(start=200.0), 20.0) == back  # the same start: nothing new


def test_a_drafters_first_drafts_are_recorded_once_per_server_start():
    ready = step(Readiness(), ready_probe(start=100.0), 0.0)
    assert (ready.drafting, ready.acceptance_length) == (False, None)
    drafting = step(ready, ready_probe(start=100.0, drafts=40.0, accepted=30.0), 10.0)
    assert (drafting.drafting, drafting.acceptance_length) == (True, 1.75)
    assert worth_recording(ready, drafting)  # the observation that confirms the drafter
    later = step(drafting, ready_probe(start=100.0, drafts=80.0, accepted=20.0), 20.0)
    assert later == drafting and not worth_recording(drafting, later)
    restarted = step(later, ready_probe(start=200.0), 30.0)  # a new drafter, not yet drafting
    assert (restarted.drafting, restarted.acceptance_length) == (False, None)


def test_without_start_time_instances_are_counted():
    first = step(Readiness(), ready_probe(start=None), 0.0)
    back = step(step(first, REFUSED, 1.0), ready_probe(start=None), 2.0)
    assert (first.instance_id, back.instance_id) == ("http://s:1#1", "http://s:1#2")


def test_readiness_survives_the_cursor_round_trip():
    ready = step(Readiness(), ready_probe(), 0.0)
    assert Readiness.from_json(ready.to_json()) == ready
