"""A tiny HTTP server that plays vLLM's probe endpoints badly on demand.

Real vLLM cannot be made to answer 503, list the wrong model, hang or be another release at
will; this can. Run as a module it takes vLLM's server arguments (what the launcher passes
the serving interpreter) and serves until killed: `stand_in_python` writes an interpreter
that does so.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Behaviour:
    health_status: int = 200
    models: list[str] = field(default_factory=lambda: ["tiny-target"])
    models_status: int = 200
    max_model_len: int = 512
    version: str = "0.0.fault"
    start_time: float = 1_700_000_000.0
    delay_s: float = 0.0  # applied to every request: a server that accepts but stalls
    requests: list[str] = field(default_factory=list)


class FaultServer:
    def __init__(self, port: int = 0) -> None:
        self.behaviour = Behaviour()
        behaviour = lambda: self.behaviour  # noqa: E731  (read at request time)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                b = behaviour()
                b.requests.append(self.path)
                time.sleep(b.delay_s)
                if self.path == "/health":
                    self._send(b.health_status, b"")
                elif self.path == "/v1/models":
                    data = [{"id": m, "max_model_len": b.max_model_len} for m in b.models]
                    self._send(b.models_status, json.dumps({"data": data}).encode())
                elif self.path == "/version":
                    self._send(200, json.dumps({"version": b.version}).encode())
                elif self.path == "/metrics":
                    text = "# TYPE process_start_time_seconds gauge\n"
                    text += f"process_start_time_seconds {b.start_time}\n"
                    self._send(200, text.encode())
                else:
                    self._send(404, b"not found")

            def _send(self, status: int, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (a timeout test)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening: later connections are refused, as with a dead vLLM."""
        self._server.shutdown()
        self._server.server_close()


def closed_port_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def stand_in_python(path: Path, version: str) -> Path:
    """An executable the launcher can take for the serving venv's python: it serves the
    probe endpoints as a vLLM of `version` for the model and port it is given."""
    repo = Path(__file__).resolve().parents[1]
    path.write_text(
        f"#!/bin/sh\nPYTHONPATH={repo} exec {sys.executable} -m eagle3_assets_tests.fault_server"
        f' --reported-version {version} "$@"\n'
    )
    path.chmod(0o755)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--reported-version", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()  # the rest of vLLM's arguments
    server = FaultServer(args.port)
    server.behaviour.version = args.reported_version
    server.behaviour.models = [args.served_model_name or args.model]
    server._server.serve_forever()


if __name__ == "__main__":
    main()
