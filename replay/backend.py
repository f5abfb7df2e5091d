"""The replayer's protocol layer: vLLM's OpenAI-compatible `/v1/completions`, streamed. How a turn
becomes a request body (sampling, logprobs, the kvbench plan, `cache_salt`) and how one request is
sent and timed, the way `vllm bench serve` times it. Scheduling (replay/runner.py) and recording
(replay/records.py) stay protocol-free."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvbench.replay.sampling import SamplingParams


@dataclass
class CompletionResult:
    sent_ns: int = 0
    first_token_ns: int | None = None
    end_ns: int | None = None
    chunk_ns: list[int] = field(default_factory=list)  # arrival of every chunk that carried tokens
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    prompt_token_ids: list[int] | None = None  # as the server saw them (echoed with return_token_ids)
    # Top-K logprobs of the first generated token ("token_id:N" -> logprob), when asked for
    first_token_logprobs: dict[str, float] | None = None
    usage: dict[str, Any] | None = None
    error_type: str | None = None
    error_message: str | None = None

    @property
    def success(self) -> bool:
        return self.error_type is None


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                            timeout_s: float, request_id: str) -> CompletionResult:
    """POST `body` with `stream: true`; a non-200 answer, an in-band error event, a broken or
    truncated stream, or a timeout is a failure whose type and message are kept."""
    result = CompletionResult()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    result.sent_ns = time.perf_counter_ns()
    try:
        await _post(session, url, body, timeout, request_id, result)
    except TimeoutError:
        result.error_type, result.error_message = "timeout", f"no complete answer within {timeout_s:g}s"
    except aiohttp.ClientConnectorError as exc:
        result.error_type, result.error_message = "connection_refused", f"cannot reach {url}: {exc}"
    except (aiohttp.ClientError, ConnectionError) as exc:
        result.error_type, result.error_message = "connection_error", f"{type(exc).__name__}: {exc}"
    except json.JSONDecodeError as exc:
        result.error_type, result.error_message = "bad_stream", f"unparseable event: {exc}"
    if result.end_ns is None or not result.success:
        result.end_ns = time.perf_counter_ns()
    return result


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout,
                request_id: str, result: CompletionResult) -> None:
    async with session.post(url, json=body, timeout=timeout, headers={"x-request-id": request_id}) as response:
        if response.status != 200:
            text = (await response.text())[:1000]
            result.error_type, result.error_message = f"http_{response.status}", text
            return
        finished = False
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line or line.startswith(b":"):
                continue  # SSE separators and keep-alive comments
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                finished = True
                break
            now = time.perf_counter_ns()
            event = json.loads(data)
            if "error" in event:  # vLLM reports failures after the 200 status in-band
                error = event["error"]
                result.error_type = "stream_error"
                result.error_message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
                return
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event.get("choices") or []:
                if choice.get("prompt_token_ids") is not None:
                    result.prompt_token_ids = choice["prompt_token_ids"]
                token_ids = choice.get("token_ids") or []
                if token_ids or choice.get("text"):
                    if result.first_token_ns is None:
                        result.first_token_ns = now
                        top = (choice.get("logprobs") or {}).get("top_logprobs") or [None]
                        if top[0]:
                            result.first_token_logprobs = {str(k): float(v) for k, v in top[0].items()}
                    result.chunk_ns.append(now)
                    result.end_ns = now
                    result.output_token_ids.extend(token_ids)
                    result.output_text += choice.get("text") or ""
        if not finished:
            result.error_type, result.error_message = "truncated_stream", "stream ended before [DONE]"
        elif result.first_token_ns is None:
            result.error_type, result.error_message = "no_tokens", "never received a token chunk"


@dataclass(frozen=True)
class CompletionsBackend:
    """Requests to vLLM's `/v1/completions` for one replay."""

    served_models: dict[str, str]  # server url -> the model name it serves
    sampling: SamplingParams
    logprobs: int = 0  # top-K logprobs of each first generated token (0: none)
    timeout_s: float = 600.0
    first_token_only: bool = False  # every request stops at its first token (replay/protocol.py)

    def body(self, url: str, token_ids: list[int], max_tokens: int, kv_transfer_params: dict[str, Any],
             salt: str | None, ignore_eos: bool = True, adapter: str | None = None) -> dict[str, Any]:
        """The request of one turn: its prompt as token ids, exactly `max_tokens` generated (or up
        to them, stopping at the model's end of sequence, when not `ignore_eos`), the plan in
        `kv_transfer_params`, and a `cache_salt` derived from `salt` when given. `adapter`: the
        LoRA adapter the turn's agent uses (vLLM takes its name as the model), else the base model."""
        body: dict[str, Any] = {
            "model": adapter or self.served_models[url], "prompt": token_ids,
            "max_tokens": 1 if self.first_token_only else max_tokens,
            "ignore_eos": ignore_eos, **self.sampling.request_fields(), "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True, "kv_transfer_params": kv_transfer_params,
        }
        if self.logprobs:  # keyed by token id, not by its (ambiguous) text
            body.update(logprobs=self.logprobs, return_tokens_as_token_ids=True)
        if salt is not None:  # approximate K/V must never serve a later exact request from vLLM's prefix cache
            body["cache_salt"] = hashlib.sha256(salt.encode()).hexdigest()[:32]
        return body

    async def send(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   request_id: str) -> CompletionResult:
        return await stream_completion(session, f"{url}/v1/completions", body, self.timeout_s, request_id)
