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
from kvbench.model.store import first_context_layer
from kvbench.server.worker_rpc import WorkerClient


def dense_reference(base_url: str, model: str, prompt: list[int], key: str, timeout_s: float = 600) -> None:
    """Prefill `prompt` with vLLM's own forward and save its cache under `key` (a salt of its own
    keeps vLLM's prefix cache from serving it blocks of approximate requests)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": key,
            "kv_transfer_params": Plan("", "", "", save_as=key, claim="none").to_params()}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read()


def dense_reference_of(base_url: str, model: str, request_id: str, prompt: list[int]) -> str:
    """A dense prefill of a replayed request's prompt, saved beside its cache; returns its key."""
    reference = str(request_id).replace("/", "_") + "-dense"
    dense_reference(base_url, model, prompt, reference)
    return reference


def turn_layer_errors(base_url: str, model: str, turn: pd.Series) -> list[dict[str, float]]:
    """Per layer {k_rel, v_rel}: ||C - C_dense||_F / ||C_dense||_F over the turn's whole prompt.
    `turn` is a row of requests.parquet recorded with --save-prompt-ids."""
    if turn.get("prompt_token_ids") is None:
        raise ValueError("the run did not store prompt token ids (replay with --save-prompt-ids)")
    reference = dense_reference_of(base_url, model, turn["request_id"], [int(t) for t in turn["prompt_token_ids"]])
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


def mean_kv_errors(base_url: str, model: str, requests: pd.DataFrame, trajectories: int) -> dict[str, Any]:
    """Normalized K/V error of each turn's whole prompt against a dense prefill of the same prompt,
    mean over the layers whose K/V depend on the context (kvbench.model.store.first_context_layer
    on: the earlier ones are exact under reuse and would only dilute the mean) of
    (||K - K_dense|| / ||K_dense|| + same for V) / 2, over every turn of the
    last `trajectories` measured trajectories (first agents included: non-chained methods correct
    them too). The mean over all those turns (the method at its realized rho) and over the turns
    whose shared query was served from a reused cache (the quality of the reuse itself)."""
    turns = requests[requests["success"]]
    turns = turns[turns["trajectory_id"].isin(sorted(set(turns["trajectory_id"]))[-trajectories:])]
    all_turns, reused_q = [], []
    first = first_context_layer(model)
    for _, row in turns.iterrows():
        layers = turn_layer_errors(base_url, model, row)[first:]
        error = sum((layer["k_rel"] + layer["v_rel"]) / 2 for layer in layers) / len(layers)
        all_turns.append(error)
        if "q" in reused_segments(row):
            reused_q.append(error)
    return {"kv_error": sum(all_turns) / len(all_turns) if all_turns else float("nan"),
            "kv_error_q_reused": sum(reused_q) / len(reused_q) if reused_q else float("nan"),
            "q_reused_turns": len(reused_q), "error_turns": len(all_turns)}
