"""A worker RPC the worker itself refused (an unsupported model at attach) is reported in the
worker's own words, not as a server set up wrongly."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvbench.server.errors import ServerError
from kvbench.server.worker_rpc import collective_rpc

REFUSAL = "the kvbench connector cannot run Gemma3ForCausalLM: ... sliding-window attention (layers 0-4)"


@pytest.fixture()
def server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            worker_ran = request["method"] == "kvbench_attach_model"
            message = (f"Call to collective_rpc method failed: Worker failed with error '{REFUSAL}', please check the "
                       "stack trace above for the root cause") if worker_ran else "Not Found"
            body = json.dumps({"error": {"message": message, "type": "InternalServerError"}}).encode()
            self.send_response(500 if worker_ran else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_a_refusal_in_the_worker_is_reported_in_its_words(server) -> None:
    url = server
    with pytest.raises(ServerError) as caught:
        collective_rpc(url, "kvbench_attach_model")
    assert str(caught.value) == f"kvbench_attach_model on {url}: {REFUSAL}"


def test_an_endpoint_that_is_not_there_still_says_how_to_start_the_server(server) -> None:
    url = server
    with pytest.raises(ServerError, match="VLLM_SERVER_DEV_MODE=1"):
        collective_rpc(url, "kvbench_stats")
