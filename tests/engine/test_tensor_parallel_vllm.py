"""Methods under tensor parallelism: each rank holds half of the KV heads, and the ranks run the
partial forward's collectives together, so whatever decides which rows are reused or computed
(KVCMAS's gate and weights, RelayCaching's and CacheBlend's picks) must be summed over all ranks' heads. Two CPU
workers of vLLM (tensor-parallel size 2) against one, on the same trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from vllm_helpers import complete, dense_prefill, new_key, reuse_q, serving

from kvbench.experiment.run import replay_and_summarize
from kvbench.methods.registry import resolve_method
from kvbench.model.store import first_context_layer
from kvbench.replay.kv_error import reused_segments, turn_layer_errors
from kvbench.replay.method_stats import rank_mismatch
from kvbench.replay.runner import ReplayConfig
from kvbench.server.config import cpu_binding, method_server_config, reserved_cpu_cores, tensor_parallel_size
from kvbench.server.errors import ServerError
from kvbench.server.lifecycle import VLLMServer
from kvbench.server.worker_rpc import WorkerClient
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import load_tokenizer

TAU = 0.3  # KVCMAS's default threshold


def test_rank_mismatch_names_what_differs() -> None:
    same = {"reused_tokens": 10, "recomputed_tokens": 2, "decisions": [{"id": "q", "decision": "accepted",
                                                                       "entropy": 0.1, "gate_s": 0.01}]}
    other_timing = {**same, "decisions": [{**same["decisions"][0], "gate_s": 0.02}], "load_s": 5.0}
    assert rank_mismatch([same, other_timing]) == []
    dense = {"reused_tokens": 0, "recomputed_tokens": 12, "decisions": [{"id": "q", "decision": "dense_gate",
                                                                        "entropy": 0.35}]}
    assert rank_mismatch([same, dense]) == ["reused_tokens", "recomputed_tokens", "decisions", "entropy"]
    picks = [{"relay": {"picked_tokens": 5, "picked_digest": digest}} for digest in ("aaa", "bbb")]
    assert rank_mismatch(picks) == ["relay.picked_digest"]


def test_tensor_parallel_flag_and_cpu_binding() -> None:
    assert tensor_parallel_size(["--max-num-seqs", "4"]) == 1
    assert tensor_parallel_size(["--tensor-parallel-size", "2"]) == 2
    assert tensor_parallel_size(["-tp=4"]) == 4
    assert cpu_binding([0, 1], 2) == "0|1"
    assert cpu_binding([0, 1, 2, 3, 4], 2) == "0,1|2,3,4"
    with pytest.raises(ServerError, match="at least 3 cores"):
        cpu_binding([0, 1], 3)


def test_every_method_gets_the_same_cpu_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keeps one more core from its CPU workers when a KV connector is configured: kvbench pins
    the reserved count, so NonShared (plain vLLM) and the connector methods compute on the same cores."""
    assert reserved_cpu_cores(2, 1) == 0  # one worker core would halve a prefill's speed (2.2 vs 1.15 s at 8K)
    assert reserved_cpu_cores(4, 1) == 1 and reserved_cpu_cores(16, 2) == 2 and reserved_cpu_cores(4, 2) == 0
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr("kvbench.server.lifecycle._has_cuda", lambda: False)
    reserved = {method: VLLMServer(method_server_config(resolve_method(method), "m")).environment()[
                "VLLM_CPU_NUM_OF_RESERVED_CPU"] for method in ("nonshared", "fullshared", "kvcmas")}
    assert set(reserved.values()) == {str(reserved_cpu_cores(len(os.sched_getaffinity(0)), 1))}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the user's own setting wins
    assert VLLMServer(method_server_config(resolve_method("kvcmas"), "m")).environment()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPU workers need two cores")


@pytest.fixture(scope="module")
def trace() -> tuple[Trace, object]:
    """Seven four-agent trajectories over a 1K query with 32-token outputs; the first three warm up
    the anchor pools."""
    tokenizer = load_tokenizer(None)
    header, trajectories = generate_trace(TraceSpec(shared_tokens=1024, output_len=32, num_trajectories=7, seed=3),
                                          tokenizer)
    return Trace(header=header, trajectories=trajectories), tokenizer


def _replay(method: str, model: str, ranks: int, trace: tuple[Trace, object], tmp: Path,
            error_turns: int = 0, params: dict | None = None, warmups: int = 3) -> tuple[dict, list[dict], list[float]]:
    """Replay the trace on a fresh server with `ranks` tensor-parallel CPU workers: the summary,
    each request's method stats and the KV error of the last `error_turns` turns whose query was
    reused (mean over the context-dependent layers of the K and V errors, over all heads). Fewer
    `warmups` (methods without an anchor pool) replay that many fewer trajectories before the four measured."""
    chosen = resolve_method(method, params or {})
    config = method_server_config(chosen, model, log_path=tmp / f"{method}-tp{ranks}.log", max_model_len=4096,
                                  extra_args=["--tensor-parallel-size", str(ranks)])
    full_trace, tokenizer = trace
    full_trace = Trace(header=full_trace.header, trajectories=full_trace.trajectories[3 - warmups:])
    out = tmp / f"{method}-tp{ranks}"
    with serving(config) as server:
        summary = replay_and_summarize(ReplayConfig.build(trace=full_trace, tokenizer=tokenizer, method=chosen,
                                                    base_urls=[server.base_url], result_dir=out, qps=0, num_warmups=warmups,
                                                    prime_method_state=True, save_prompt_ids=True,
                                                    show_progress=False))
        requests = pd.read_parquet(out / "requests.parquet")
        assert requests["success"].all() and len(requests) == 16
        errors = []
        q_reused = requests.apply(lambda turn: "q" in reused_segments(turn), axis=1)
        for _, turn in requests[q_reused].tail(error_turns).iterrows():
            layers = turn_layer_errors(server.base_url, config.model, turn)[first_context_layer(config.model):]
            errors.append(sum((layer["k_rel"] + layer["v_rel"]) / 2 for layer in layers) / len(layers))
    return summary, requests["method_stats"].map(lambda s: json.loads(s) if s else {}).tolist(), errors


@needs_two_cores
def test_kvcmas_two_ranks_decide_as_one(default_model: str, trace: tuple[Trace, object], tmp_path: Path) -> None:
    one, one_stats, one_errors = _replay("kvcmas", default_model, 1, trace, tmp_path, error_turns=2)
    # Two ranks with prematch: each keeps its heads' share of the distances, summed when deciding.
    two, two_stats, two_errors = _replay("kvcmas", default_model, 2, trace, tmp_path, error_turns=2,
                                         params={"prematch": True})
    # The ranks agreed on every request (same reuse, decisions and entropies), and reported as two.
    assert two["rank_mismatched_requests"] == 0
    assert all(stats.get("tp_ranks") == 2 for stats in two_stats if "decisions" in stats)
    # (prematched at loaded sources only: A1 reads q from A0, which vLLM prefilled itself)
    queries = [d for stats in two_stats if stats.get("agent") != "A1"
               for d in stats.get("decisions", []) if d["id"] == "q" and "entropy" in d]
    assert queries and all(d["memo_anchors"] == d["anchors"] for d in queries)
    # ...and as one rank does: the gate sees all heads (only bf16 rounding of the split GEMMs differs).
    # Compared on the shared query, whose cache and anchors depend on the trace alone: the agents'
    # outputs may differ between the runs once a near-tie in a greedy decode breaks the other way,
    # and with them the output segments and their anchors.
    # The gate's entropy is a softmax over a few anchors' distances, so one rounding of a distance
    # can move it by a tenth (0.107 seen once): the entropies agree as a whole (median), and the
    # decisions agree wherever the one-rank entropy is not within that of the threshold.
    decided, entropy_gaps = 0, []
    for a, b in zip(one_stats, two_stats):
        for da, db in zip(a.get("decisions", []), b.get("decisions", []), strict=True):
            assert da["id"] == db["id"]
            if da["id"] == "q" and da.get("entropy") is not None and db.get("entropy") is not None:
                entropy_gaps.append(abs(da["entropy"] - db["entropy"]))
                if abs(da["entropy"] - TAU) > 0.15:
                    assert da["decision"] == db["decision"], (da, db)
                    decided += 1
    assert entropy_gaps and float(np.median(entropy_gaps)) < 0.05 and max(entropy_gaps) < 0.25, entropy_gaps
    assert decided >= 8  # of 12 (4 measured trajectories x 3 reuse turns)
    assert one["realized_rho"] > 0.2 and abs(one["realized_rho"] - two["realized_rho"]) < 0.05
    # The corrected caches match too: KV error over both ranks' heads, as with one rank. (Loosely:
    # where the runs' outputs differ, so do these turns' prompts.)
    assert len(one_errors) == len(two_errors) == 2
    for e1, e2 in zip(one_errors, two_errors):
        assert 0 < e2 < 0.2 and abs(e1 - e2) <= 0.5 * e1, (one_errors, two_errors)
    # Each rank factorizes its own heads' share of an anchor: B factors split between the ranks,
    # A factors [tokens, r] are kept by each. The run reports the server's bytes, over both ranks.
    pool_one, pool_two = (run["method_state_bytes"]["peak_anchor_pool"] for run in (one, two))
    assert pool_one < pool_two < 2 * pool_one


@needs_two_cores
@pytest.mark.parametrize(("method", "stats_key"), [("relaycaching", "relay"), ("cacheblend", "blend")])
def test_selective_recomputation_ranks_pick_the_same_rows(default_model: str, trace: tuple[Trace, object],
                                                          tmp_path: Path, method: str, stats_key: str) -> None:
    """The rows to recompute are picked from deviations (and RelayCaching's attention influence)
    over all heads: both ranks pick the same rows (compared by digest)."""
    summary, stats, _ = _replay(method, default_model, 2, trace, tmp_path, warmups=0)  # no state to warm
    assert summary["rank_mismatched_requests"] == 0
    picks = [s[stats_key] for s in stats if stats_key in s]
    assert len(picks) == 12 and all(p["picked_digest"] for p in picks)
    assert 0 < sum(p["picked_tokens"] for p in picks) < sum(p["candidate_tokens"] for p in picks)


@needs_two_cores
def test_a_load_failing_on_one_rank_falls_back_on_every_rank(default_model: str, prompts: dict,
                                                              tmp_path: Path) -> None:
    """Rank 0 alone places a non-finite value: both ranks must give up the load together (the
    check is summed over ranks), else rank 1 would run the partial forward's collectives alone and
    the engine would hang. vLLM then computes the request itself: the dense answer."""
    config = method_server_config(resolve_method("fullshared"), default_model, log_path=tmp_path / "tp2-fault.log",
                                  max_model_len=4096, extra_args=["--tensor-parallel-size", "2"])
    config.kv_transfer_config["kv_connector_extra_config"]["fault_injection"] = "flagged_nonfinite_rank0"
    with serving(config) as server:
        source, key = new_key(), new_key()
        dense_prefill(server, prompts["p0"], source)
        dense = dense_prefill(server, prompts["p1"], new_key(), max_tokens=8)
        faulty = complete(server, prompts["p1"], reuse_q(prompts, "p1", source, key, inject_fault=True),
                           salt=key, max_tokens=8)
        ranks = [worker.requests[key] for worker in WorkerClient(server.base_url).stats()]
    assert faulty["text"] == dense["text"]
    assert len(ranks) == 2
    for stats in ranks:
        assert stats["fallback"] == "dense" and "non-finite" in stats["error"], stats
