import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from eagle3_assets.lib.generation.batch import (
    generate_batch,
    run_batch,
    sample_seed,
    settings_fingerprint,
)
from eagle3_assets.lib.generation.chat_client import ChatClient, ServerLooksDead
from eagle3_assets.lib.generation.conversations import Conversation
from eagle3_assets.lib.generation.settings import GenerationConfig
from eagle3_assets.lib.generation.store import SCHEMA, GenerationStore
from eagle3_assets_tests.fault_server import closed_port_url
from eagle3_assets_tests.openai_stub import OpenAIStub

MODEL = "tiny-target"
FAST = GenerationConfig(max_tokens=64, backoff_base_s=0.01, backoff_max_s=0.05)


def pool(count, prefix="question"):
    return [
        Conversation(f"p{i:03d}", [{"role": "user", "content": f"{prefix} {i}"}])
        for i in range(count)
    ]


def config(**changes):
    return GenerationConfig(**{**FAST.__dict__, **changes})


def final_rows(summary):
    assert summary.final_path is not None and summary.final_path.exists()
    return pq.read_table(summary.final_path).to_pylist()


@pytest.fixture
def stub():
    with OpenAIStub() as server:
        yield server


def test_happy_path_writes_one_row_per_prompt_with_every_column(tmp_path):
    prompts = pool(30)
    reports = []
    settings = config(
        seed=11, max_tokens=8, chat_template_kwargs={"thinking": True}, return_token_ids=True
    )
    with OpenAIStub(api_key="sekrit") as server:
        server.faults.latency_s = 0.05
        summary = run_batch(
            prompts, tmp_path, [server.base_url], MODEL, settings, "sekrit", reports.append
        )
    rows = final_rows(summary)
    assert pq.read_schema(summary.final_path).names == SCHEMA.names
    assert [row["prompt_id"] for row in rows] == [c.prompt_id for c in prompts]
    fingerprint = settings_fingerprint(MODEL, settings)
    row = rows[3]
    assert row["sample_id"] == f"p003-{fingerprint}"
    assert json.loads(row["messages"]) == prompts[3].messages
    assert row["response"].startswith("w") and len(row["response"].split()) == 8
    assert row["reasoning"].startswith("thinking ")
    assert (row["finish_reason"], row["prompt_tokens"], row["completion_tokens"]) == (
        "length",
        2,
        8,
    )
    assert row["prompt_token_ids"] == [0, 1] and len(row["token_ids"]) == 8
    assert (row["model"], row["seed"]) == (MODEL, sample_seed(11, "p003"))
    assert min(r["latency_s"] for r in rows) >= 0.05  # the server's delay is in every latency
    sent = server.last_payload
    assert sent["max_tokens"] == 8 and sent["chat_template_kwargs"] == {"thinking": True}
    assert sent["return_token_ids"] is True and sent["top_p"] == 1.0
    assert (summary.total, summary.resumed, summary.requested, summary.completed) == (30, 0, 30, 30)
    assert (summary.failed, summary.retries, summary.errors) == (0, 0, 0)
    assert (summary.prompt_tokens, summary.completion_tokens) == (60, 240)
    assert summary.finish_reasons == {"length": 30}
    assert summary.requests_per_s == 30 / summary.seconds
    assert summary.output_tokens_per_s == 240 / summary.seconds
    assert not (tmp_path / "parts").exists()
    assert reports[0].done == 0 and reports[-1].done == 30 and reports[-1].eta_s == 0
    assert "30/30 done (0 resumed)" in str(reports[-1])


def test_without_token_ids_or_thinking_those_columns_are_null(tmp_path, stub):
    without_ids = GenerationConfig(**{**FAST.__dict__, "return_token_ids": False})
    summary = run_batch(pool(3), tmp_path, [stub.base_url], MODEL, without_ids)
    row = final_rows(summary)[0]
    assert row["reasoning"] is None and row["token_ids"] is None
    assert row["prompt_token_ids"] is None and row["finish_reason"] == "stop"
    assert "return_token_ids" not in stub.last_payload
    assert "chat_template_kwargs" not in stub.last_payload


def test_503_bursts_and_connection_resets_are_retried(tmp_path, stub):
    stub.faults.burst = 6
    stub.faults.resets = 4
    summary = run_batch(pool(40), tmp_path, [stub.base_url], MODEL, config(concurrency=8))
    assert len(final_rows(summary)) == 40
    assert summary.retries == summary.errors == 10
    assert stub.total_requests == 50 and stub.answered == 40


def test_a_400_fails_that_sample_at_once_with_the_servers_message(tmp_path, stub):
    prompts = pool(20)
    stub.faults.reject = {"question 5": "This model's maximum context length is 512 tokens"}
    summary = run_batch(prompts, tmp_path, [stub.base_url], MODEL, FAST)
    assert summary.failed == 1 and summary.final_path is None
    assert "answered 400: This model's maximum context length" in summary.failures["p005"]
    assert stub.requests["question 5"] == 1  # no retries
    assert not GenerationStore(tmp_path).final_path.exists()
    assert len(GenerationStore(tmp_path).completed_ids()) == 19

    stub.faults.reject = {}
    again = run_batch(prompts, tmp_path, [stub.base_url], MODEL, FAST)
    assert (again.resumed, again.requested, again.failed) == (19, 1, 0)
    # this run's rates count this run's completions, not the resumed rows
    assert again.requests_per_s == 1 / again.seconds
    assert again.output_tokens_per_s == 16 / again.seconds
    assert stub.requests["question 5"] == 2 and stub.total_requests == 21
    assert len(final_rows(again)) == 20


def test_a_sample_that_exhausts_its_retries_is_reported_not_written(tmp_path, stub):
    stub.faults.burst = 3
    summary = run_batch(pool(1), tmp_path, [stub.base_url], MODEL, config(max_attempts=3))
    assert summary.failed == 1 and summary.retries == 2 and summary.final_path is None
    assert "3 attempts failed" in summary.failures["p000"]
    assert "answered 503: server overloaded" in summary.failures["p000"]


def test_a_dead_server_trips_the_breaker_with_a_clear_error(tmp_path):
    dead = closed_port_url()
    with pytest.raises(ServerLooksDead, match="after 20 consecutive failed requests") as error:
        run_batch(pool(50), tmp_path, [dead], MODEL, FAST)
    assert dead in str(error.value) and "look dead" in str(error.value)
    assert "ClientConnectorError" in str(error.value)  # the last error says what failed
    assert not GenerationStore(tmp_path).final_path.exists()


def test_the_breaker_stops_after_its_threshold_not_after_every_retry(tmp_path, stub):
    """A server that drops every connection: 20 failed attempts end the run, not 50 samples
    x 8 attempts each (one request more may be on its way when the breaker trips)."""
    stub.faults.resets = 10_000
    with pytest.raises(ServerLooksDead, match="after 20 consecutive failed requests"):
        run_batch(pool(50), tmp_path / "a", [stub.base_url], MODEL, config(concurrency=1))
    assert stub.total_requests in (20, 21) and stub.answered == 0
    assert not GenerationStore(tmp_path / "a").final_path.exists()


def test_an_engine_that_dies_mid_batch_trips_the_breaker(tmp_path, stub):
    stub.faults.latency_s = 0.01

    async def kill_engine_after(count):
        while stub.answered < count:
            await asyncio.sleep(0.005)
        stub.faults.status = 500

    async def scenario():
        killer = asyncio.create_task(kill_engine_after(15))
        with pytest.raises(ServerLooksDead, match="answered 500: engine dead"):
            await generate_batch(pool(200), tmp_path, [stub.base_url], MODEL, config(concurrency=4))
        await killer

    asyncio.run(scenario())
    persisted = GenerationStore(tmp_path).completed_ids()
    assert 15 - 4 <= len(persisted) <= stub.answered
    assert not GenerationStore(tmp_path).final_path.exists()


def test_a_wrong_api_key_fails_with_the_message_and_the_key_never_shows(tmp_path):
    with OpenAIStub(api_key="right") as server, pytest.raises(ServerLooksDead) as error:
        settings = config(concurrency=1)
        run_batch(pool(30), tmp_path, [server.base_url], MODEL, settings, api_key="wrong-secret")
    assert "answered 401: invalid API key" in str(error.value)
    assert "wrong-secret" not in str(error.value)
    assert 20 <= server.total_requests <= 21  # the breaker stopped it (one more may start)
    assert max(server.requests.values()) == 1  # 4xx are not retried


def test_cancel_then_resume_sends_only_the_missing_samples(tmp_path, stub):
    prompts = pool(40)
    stub.faults.latency_s = 0.03

    async def cancel_after(count):
        task = asyncio.create_task(
            generate_batch(prompts, tmp_path, [stub.base_url], MODEL, config(concurrency=4))
        )
        while stub.answered < count:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after(12))
    store = GenerationStore(tmp_path)
    persisted = len(store.completed_ids())
    assert not store.final_path.exists()
    assert 12 - 4 <= persisted <= stub.answered  # at most the in-flight requests are lost
    first_run = stub.total_requests

    summary = run_batch(prompts, tmp_path, [stub.base_url], MODEL, config(concurrency=4))
    assert stub.total_requests - first_run == 40 - persisted
    assert (summary.resumed, summary.requested) == (persisted, 40 - persisted)
    rows = final_rows(summary)
    assert sorted(row["prompt_id"] for row in rows) == [c.prompt_id for c in prompts]


KILLED_RUN = """
import sys
from eagle3_assets.lib.generation.conversations import load_conversations
from eagle3_assets.lib.generation.batch import run_batch
from eagle3_assets.lib.generation.settings import GenerationConfig
url, pool_path, out_dir = sys.argv[1:]
run_batch(load_conversations(pool_path), out_dir, [url], "tiny-target",
          GenerationConfig(concurrency=5, flush_every_s=0.1))
"""


def test_kill_9_mid_batch_loses_only_in_flight_work(tmp_path, stub):
    prompts = pool(60)
    pool_path = tmp_path / "pool.jsonl"
    pool_path.write_text(
        "".join(
            json.dumps({"prompt_id": c.prompt_id, "messages": c.messages}) + "\n" for c in prompts
        )
    )
    out_dir = tmp_path / "batch-00000"
    store = GenerationStore(out_dir)
    stub.faults.latency_s = 0.2
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, stub.base_url, str(pool_path), str(out_dir)]
    )
    try:
        deadline = time.monotonic() + 30
        while len(store.completed_ids()) < 15 and time.monotonic() < deadline:
            assert child.poll() is None, "the batch ended before it could be killed"
            time.sleep(0.05)
        answered = stub.answered
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not store.final_path.exists()
    persisted = len(store.completed_ids())
    assert answered - persisted <= 5 + 3  # in flight, plus at most one flush interval
    first_run = stub.total_requests

    stub.faults.latency_s = 0.0
    summary = run_batch(prompts, out_dir, [stub.base_url], MODEL, GenerationConfig())
    second_run = stub.total_requests - first_run
    assert second_run == 60 - persisted < 60
    rows = final_rows(summary)
    assert len(rows) == 60 and len({row["prompt_id"] for row in rows}) == 60


def test_200_concurrent_requests_are_not_capped_by_the_connector(tmp_path, stub):
    stub.faults.latency_s = 1.0  # the first answers wait until all 200 requests arrived
    summary = run_batch(pool(400), tmp_path, [stub.base_url], MODEL, config(concurrency=200))
    assert summary.completed == 400
    assert stub.max_in_flight == 200  # the concurrency asked for, no cap below it


def test_several_replicas_share_the_load_and_a_dead_one_is_avoided(tmp_path):
    with OpenAIStub() as first, OpenAIStub() as second:
        first.faults.latency_s = second.faults.latency_s = 0.02
        urls = [first.base_url, second.base_url]
        shared = run_batch(pool(100), tmp_path / "a", urls, MODEL, config(concurrency=10))
        assert first.total_requests > 30 and second.total_requests > 30
        assert first.total_requests + second.total_requests == 100
        rows = final_rows(shared)  # every sample exactly once, whichever replica answered it
        assert sorted(row["prompt_id"] for row in rows) == [c.prompt_id for c in pool(100)]

        dead, answered_before = closed_port_url(), first.answered
        summary = run_batch(pool(100), tmp_path / "b", [first.base_url, dead], MODEL, FAST)
    assert summary.completed == 100 and summary.failed == 0
    assert summary.errors >= 1 and summary.retries == summary.errors  # each failure retried
    assert first.answered - answered_before == 100  # every sample answered by the live one
    assert sorted(row["prompt_id"] for row in final_rows(summary)) == [
        c.prompt_id for c in pool(100)
    ]


def test_changed_settings_regenerate_instead_of_resuming(tmp_path, stub):
    prompts = pool(5)
    run_batch(prompts, tmp_path, [stub.base_url], MODEL, FAST)
    unchanged = run_batch(prompts, tmp_path, [stub.base_url], MODEL, FAST)
    assert (unchanged.resumed, unchanged.requested, stub.total_requests) == (5, 0, 5)
    reseeded = run_batch(prompts, tmp_path, [stub.base_url], MODEL, config(seed=1))
    assert (reseeded.resumed, reseeded.requested, stub.total_requests) == (0, 5, 10)
    assert {row["seed"] for row in final_rows(reseeded)} == {
        sample_seed(1, c.prompt_id) for c in prompts
    }


def test_a_connection_idle_past_the_servers_close_is_never_reused(tmp_path):
    """vLLM closes a keep-alive connection after 5 s idle; a client that reuses it just then
    sends into a closed socket and gets ServerDisconnected. The client's event loop is
    blocked until the server has closed the idle connection, so the client cannot have seen
    the close: only its own keep-alive limit (KEEPALIVE_S, below 5 s) keeps it off that
    connection. A limit above the server's makes the third call fail once (errors == 1)."""

    def wait_for_the_servers_close(server: OpenAIStub) -> None:
        deadline = time.monotonic() + 30
        while server.open_connections and time.monotonic() < deadline:
            time.sleep(0.01)  # blocking on purpose: the client's loop must not run
        assert server.open_connections == 0, "the stub never closed the idle connection"

    async def three_calls(server: OpenAIStub) -> tuple[int, int]:
        async with ChatClient([server.base_url], MODEL, FAST) as client:
            for content in ("one", "two"):
                await client.complete([{"role": "user", "content": content}], seed=0)
            wait_for_the_servers_close(server)
            await client.complete([{"role": "user", "content": "three"}], seed=0)
            return client.errors, client.retries

    with OpenAIStub(keepalive_s=5.0) as server:  # vLLM's (uvicorn's) idle close
        errors, retries = asyncio.run(three_calls(server))
    assert (errors, retries, server.answered) == (0, 0, 3)
    first, second, third = server.client_ports
    assert first == second  # keep-alive works: the second call reused the first connection
    assert third != first  # the connection the server closed was not reused


def test_store_dedupes_rows_and_never_finalizes_an_incomplete_batch(tmp_path):
    store = GenerationStore(tmp_path)

    def row(sample_id):
        return {"sample_id": sample_id, "prompt_id": sample_id, "messages": "[]", "response": "r"}

    store.write_part([row("a"), row("b")])
    store.write_part([row("b"), row("stale")])
    assert store.completed_ids() == {"a", "b", "stale"}
    with pytest.raises(ValueError, match="1 of 3 samples have no row"):
        store.finalize(["a", "b", "c"])
    assert not store.final_path.exists()
    store.finalize(["b", "a"])
    assert [r["sample_id"] for r in pq.read_table(store.final_path).to_pylist()] == ["b", "a"]
    assert store.completed_ids() == {"a", "b"} and not store.parts_dir.exists()


def test_sample_seeds_are_stable_and_distinct():
    seeds = {sample_seed(0, f"p{i}") for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= seed < 2**31 for seed in seeds)
    assert sample_seed(5, "p1") == (sample_seed(0, "p1") + 5) % 2**31
