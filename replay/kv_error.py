"""KV error of replayed turns against dense prefills of the same prompts, on the server that ran
them: each prompt is prefilled again by vLLM itself (claiming nothing) and saved as a reference,
and the connector compares the two saved caches layer by layer."""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

import pandas as pd

from kvbench.contracts import Plan
from kvbench.replay.worker_rpc import WorkerClient


def dense_reference(base_url: str, model: str, prompt: list[int], key: str, timeout_s: float = 600) -> None:
    """Prefill `prompt` with vLLM's own forward and save its cache under `key` (a salt of its own
    keeps vLLM's prefix cache from serving it blocks of approximate requests)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": key,
            "kv_transfer_params": Plan("", "", "", save_as=key, claim=False).to_params()}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read()


def turn_layer_errors(base_url: str, model: str, turn: pd.Series) -> list[dict[str, float]]:
    """Per layer {k_rel, v_rel}: ||C - C_dense||_F / ||C_dense||_F over the turn's whole prompt.
    `turn` is a row of requests.parquet recorded with --save-prompt-ids."""
    if turn.get("prompt_token_ids") is None:
        raise ValueError("the run did not store prompt token ids (replay with --save-prompt-ids)")
    reference = str(turn["request_id"]).replace("/", "_") + "-dense"
    dense_reference(base_url, model, [int(t) for t in turn["prompt_token_ids"]], reference)
    ranks = WorkerClient(base_url).kv_error(turn["request_id"], reference, 0, int(turn["prompt_tokens"]) - 1)
    return combine_ranks([rank["layers"] for rank in ranks])


def combine_ranks(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per layer {k_rel, v_rel} over all heads from each tensor-parallel rank's share of them
    (sqrt of summed squared errors over summed squared reference norms)."""
    layers = []
    for shards in zip(*per_rank):
        layers.append({f"{name}_rel": math.sqrt(sum(s[f"{name}_sq_err"] for s in shards)
                                                / max(sum(s[f"{name}_sq_ref"] for s in shards), 1e-30))
                       for name in ("k", "v")})
    return layers


def reused_segments(turn: pd.Series) -> set[str]:
    """Ids of the shared segments the method served from a reused cache in this turn."""
    stats: Any = json.loads(turn["method_stats"]) if isinstance(turn["method_stats"], str) else {}
    return {s["id"] for s in stats.get("segments", []) if s.get("reused")}
