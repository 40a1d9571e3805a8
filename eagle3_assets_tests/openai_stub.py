"""A local OpenAI-compatible chat server that answers deterministically and fails on demand.

Real vLLM cannot be told to answer 503 five times, drop a connection mid-request or reject
one prompt; this can. It closes idle keep-alive connections after 5 s, as vLLM does, and
counts what it saw: requests per prompt (keyed by the last message's content), requests in
flight and their maximum. Runs in a background thread (`with OpenAIStub() as stub:`) or as
a process (`python -m eagle3_assets_tests.openai_stub`, prints its base URL).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Faults:
    """Read at request time; tests change them while the server runs."""

    latency_s: float = 0.0
    burst: int = 0  # the next `burst` requests answer `burst_status`
    burst_status: int = 503
    resets: int = 0  # the next `resets` requests lose their connection mid-request
    reject: dict[str, str] = field(default_factory=dict)  # last message content -> 400 message
    status: int | None = None  # every request answers this (500: a dying engine)
    completion_tokens: int = 16  # answer length when max_tokens allows


class OpenAIStub:
    def __init__(self, api_key: str | None = None, keepalive_s: float = 5.0) -> None:
        self.faults = Faults()
        self.api_key = api_key
        self.keepalive_s = keepalive_s
        self.requests: Counter[str] = Counter()  # chat requests per prompt, faults included
        self.answered = 0  # 200s sent
        self.in_flight = 0
        self.max_in_flight = 0
        self.last_payload: dict | None = None
        self.client_ports: list[int] = []  # each chat request's client port: its connection
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def open_connections(self) -> int:
        """Client connections the server holds open (idle ones close after keepalive_s)."""
        return len(self._runner.server.connections) if self._runner else 0

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening and drop open connections: later requests are refused."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", lambda request: web.Response())
        self._runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=self.keepalive_s, shutdown_timeout=0.1
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.last_payload = payload
        self.client_ports.append(request.transport.get_extra_info("peername")[1])
        prompt = payload["messages"][-1]["content"]
        self.requests[prompt] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request, payload, prompt)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, payload: dict, prompt: str) -> web.Response:
        faults = self.faults
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "invalid API key")
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        if faults.resets > 0:
            faults.resets -= 1
            request.transport.abort()  # the client sees the connection die mid-request
            raise asyncio.CancelledError
        if faults.burst > 0:
            faults.burst -= 1
            return _error(faults.burst_status, "server overloaded, try again")
        if faults.status is not None:
            return _error(faults.status, "engine dead")
        if prompt in faults.reject:
            return _error(400, faults.reject[prompt])
        self.answered += 1
        return web.json_response(_completion(payload, faults.completion_tokens))


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "StubError", "code": status}}
    return web.json_response(body, status=status)


def _completion(payload: dict, length: int) -> dict:
    """A deterministic answer: a hash of the messages and the seed, spelled as words."""
    messages = payload["messages"]
    key = json.dumps([messages, payload.get("seed")], sort_keys=True).encode()
    digest = hashlib.sha256(key).hexdigest()
    max_tokens = payload["max_tokens"]
    count = min(length, max_tokens)
    words = [f"w{digest[i % 64]}{i}" for i in range(count)]
    prompt_tokens = sum(len(message["content"].split()) for message in messages)
    thinking = (payload.get("chat_template_kwargs") or {}).get("thinking", False)
    choice = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": " ".join(words),
            "reasoning": f"thinking {digest[:8]}" if thinking else None,
        },
        "finish_reason": "length" if max_tokens < length else "stop",
    }
    body = {
        "id": f"chatcmpl-{digest[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": payload["model"],
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "total_tokens": prompt_tokens + count,
        },
    }
    if payload.get("return_token_ids"):
        body["prompt_token_ids"] = list(range(prompt_tokens))
        choice["token_ids"] = [int(digest[i % 64], 16) for i in range(count)]
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--completion-tokens", type=int, default=16)
    args = parser.parse_args()
    with OpenAIStub() as stub:
        stub.faults.latency_s = args.latency_s
        stub.faults.completion_tokens = args.completion_tokens
        print(stub.base_url, flush=True)
        threading.Event().wait()  # serve until killed


if __name__ == "__main__":
    main()
