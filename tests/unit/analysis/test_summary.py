"""`kvbench.analysis.summary`: a run's summary.json recomputed from the files the replayer wrote."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from paths import DATA

from kvbench import run_files
from kvbench.analysis.summary import server_figures, store_figures, summarize_run, write_summary

GOLDEN = DATA / "golden-runs"


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)
    return a == b


@pytest.mark.parametrize("method", ["nonshared", "fullshared"])
def test_the_recorded_summary_is_recomputed_from_the_run_files(method: str) -> None:
    """The golden summaries were written when the replay ended; the same figures come back from
    the files alone (every key, every value)."""
    recorded = json.loads((GOLDEN / method / run_files.SUMMARY).read_text())
    recomputed = json.loads(json.dumps(summarize_run(GOLDEN / method)))
    assert set(recomputed) == set(recorded)
    differing = {k for k in recorded if not _same(recorded[k], recomputed[k])}
    assert not differing
    assert recomputed["completed"] == 24 and recomputed["method"] == method
    # ...and figures computed here from requests.parquet alone, not by the summarizer, agree with
    # them (the golden files were written by the code under test: they cannot catch its errors).
    import numpy as np

    requests = pd.read_parquet(GOLDEN / method / run_files.REQUESTS)
    ok = requests[requests["success"]]
    assert recomputed["failed"] == int((~requests["success"]).sum())
    for p in (50, 90, 99):
        assert recomputed[f"p{p}_ttft_ms"] == pytest.approx(float(np.percentile(ok["ttft_ms"], p)))
    assert recomputed["mean_ttft_ms"] == pytest.approx(float(ok["ttft_ms"].mean()))
    assert recomputed["mean_e2el_ms"] == pytest.approx(float(ok["e2el_ms"].mean()))
    span_s = (requests["end_ns"].max() - requests["scheduled_ns"].min()) / 1e9
    assert recomputed["duration"] >= span_s  # the run lasted at least as long as its requests
    assert recomputed["request_throughput"] == pytest.approx(len(ok) / recomputed["duration"])
    assert recomputed["output_throughput"] == pytest.approx(ok["output_tokens"].sum() / recomputed["duration"])
    if method == "fullshared":
        assert recomputed["realized_rho"] == pytest.approx(ok["reused_tokens"].sum() / ok["eligible_tokens"].sum())


def _lines(path: Path, entries: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"torn line')


def test_store_figures_are_the_last_segments_over_its_servers(tmp_path: Path) -> None:
    def state(segment: int, url: str, peak: int, evictions: int, anchors: int) -> dict:
        return {"kind": "state", "segment": segment, "server_url": url, "store_bytes": peak // 2,
                "store_peak_bytes": peak, "store_evictions": evictions, "store_refused": 1,
                "method_state_bytes": {"anchor_pool": anchors}}

    _lines(tmp_path / run_files.METHOD_STATS, [
        state(0, "a", 10_000, 9, 999),  # an earlier segment: not this run's figures
        {"kind": "request", "request_id": "r", "stats": {"reused_tokens": 3}},
        state(1, "a", 100, 1, 50), state(1, "b", 300, 2, 20),
        state(1, "a", 200, 4, 30),  # a's later answer: its peak grew, its evictions are counted once
    ])
    figures = store_figures(tmp_path, 1)
    assert figures == {"method_store_peak_bytes": 300, "store_evictions": 4 + 2, "store_refused": 2,
                       "method_state_bytes": {"anchor_pool": 50}}
    assert store_figures(tmp_path, 2)["method_store_peak_bytes"] is None  # no server reported


def test_server_figures_add_each_servers_own_deltas(tmp_path: Path) -> None:
    hits = "vllm:prefix_cache_hits_total"
    _lines(tmp_path / run_files.SERVER_METRICS, [
        {"segment": 0, "server_url": "a", hits: 0.0, "process_tree_rss_bytes": 9e9},
        {"segment": 1, "server_url": "a", hits: 10.0, "process_tree_rss_bytes": 5},
        {"segment": 1, "server_url": "b", hits: 100.0, "vllm:kv_cache_usage_perc": 0.5},
        {"segment": 1, "server_url": "a", hits: 15.0, "process_tree_rss_bytes": 7},
        {"segment": 1, "server_url": "b", hits: 130.0, "vllm:kv_cache_usage_perc": 0.25},
    ])
    figures = server_figures(tmp_path, 1)
    assert figures["prefix_cache_hits"] == 5 + 30
    assert figures["peak_server_rss_bytes"] == 7 and figures["peak_kv_cache_usage_perc"] == 0.5
    assert figures["num_preemptions"] is None  # no server exposed it


def test_a_stopped_resumed_run_is_summarized_over_its_segments(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "fullshared", run)
    config = json.loads((run / run_files.CONFIG).read_text())
    first = dict(config["segments"][0], duration_s=2.0, status="interrupted by SIGTERM")
    config["segments"] = [first, dict(first, duration_s=3.0, status="interrupted by SIGINT",
                                      method_stats_missing=["x", "y"])]
    (run / run_files.CONFIG).write_text(json.dumps(config))
    requests = pd.read_parquet(run / run_files.REQUESTS)
    requests.loc[0, "method_stats"] = json.dumps({"reused_tokens": 0, "rank_mismatch": ["decisions"]})
    requests.to_parquet(run / run_files.REQUESTS)
    # The resumed segment's store (reset at its start) peaked lower and evicted 3 entries.
    with open(run / run_files.METHOD_STATS, "a") as journal:
        journal.write(json.dumps({"kind": "state", "segment": 1, "server_url": "http://x", "t_s": 1.0,
                                  "store_bytes": 100, "store_peak_bytes": 1000, "store_evictions": 3,
                                  "store_refused": 1, "method_state_bytes": {"anchors": 7}}) + "\n")
    summary = write_summary(run)
    assert json.loads((run / run_files.SUMMARY).read_text())["interrupted"] == "SIGINT" == summary["interrupted"]
    # rates over the active time, named as such: 2 s + 3 s, the pause between them left out
    assert summary["duration"] == 5.0 and summary["segments"] == 2 and summary["segment_durations_s"] == [2.0, 3.0]
    assert summary["duration_basis"] == "active: 2 segments added, pauses left out"
    assert summary["method_stats_missing"] == 2 and summary["method_stats_missing_requests"] == ["x", "y"]
    assert summary["rank_mismatched_requests"] == 1
    # the peak of any segment (the first's 24,576 bytes, not the last's 1,000); counts added
    assert summary["method_store_peak_bytes"] == 24576
    assert (summary["store_evictions"], summary["store_refused"]) == (3, 1)
    assert summary["method_state_bytes"] == {"anchors": 7}


def test_a_directory_without_requests_is_named(tmp_path: Path) -> None:
    (tmp_path / run_files.CONFIG).write_text(json.dumps({"segments": []}))
    with pytest.raises(FileNotFoundError, match=r"requests\.parquet"):
        summarize_run(tmp_path)


def test_kvbench_summarize_rewrites_the_summaries_of_a_sweep(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvbench.cli import main

    for method in ("nonshared", "fullshared"):
        shutil.copytree(GOLDEN / method, tmp_path / "runs" / method)
        (tmp_path / "runs" / method / run_files.SUMMARY).unlink()
    result = CliRunner().invoke(main, ["summarize", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for method in ("nonshared", "fullshared"):
        written = json.loads((tmp_path / "runs" / method / run_files.SUMMARY).read_text())
        assert written["p50_ttft_ms"] == json.loads((GOLDEN / method / run_files.SUMMARY).read_text())["p50_ttft_ms"]
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = CliRunner().invoke(main, ["summarize", str(empty)])
    assert refused.exit_code == 1 and "no kvbench runs" in refused.output


def test_the_shared_tiers_figures_come_from_each_servers_latest_state() -> None:
    from kvbench.analysis.shared_tier import shared_tier_figures

    def state(url: str, segment: int, **tier) -> dict:
        return {"kind": "state", "segment": segment, "server_url": url, "shared_tier": tier}

    journal = [state("a", 0, local_hits=9, remote_hits=9), state("a", 1, local_hits=1, remote_hits=0),
               state("a", 1, local_hits=3, remote_hits=1, misses=1, remote_bytes=800, get_s=[0.002]),
               state("b", 1, local_hits=2, remote_hits=3, remote_bytes=2400, get_s=[0.004, 0.006], puts=4,
                     put_bytes=3200, put_s=0.02)]
    metrics = [{"segment": 1, "server_url": "m", "master_allocated_bytes": v} for v in (1000, 3200, 2000)]
    out = shared_tier_figures(journal, metrics, reused_tokens=100)
    assert (out["shared_local_hits"], out["shared_remote_hits"], out["shared_misses"]) == (5, 4, 1)
    assert out["shared_remote_bytes"] == 3200 and out["shared_remote_bytes_per_reused_token"] == 32
    assert out["p50_shared_get_ms"] == pytest.approx(4.0) and out["shared_remote_gets"] == 3
    assert out["shared_remote_hit_share"] == pytest.approx(0.4) and out["shared_store_peak_bytes"] == 3200
    assert out["shared_put_ms_total"] == pytest.approx(20.0)
    assert shared_tier_figures([{"kind": "state", "segment": 0, "server_url": "a"}], [], 5) == {}


def test_a_run_records_its_servers_memory_from_their_workers(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Each server's workers are asked for their memory at the run's start (a new peak) and end;
    the summary's CPU twin adds the parts. A server without kvbench's worker extension gives none."""
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.replay.stub import StubServer

    args = ["--model", str(tiny_tokenizer_dir), "--shared-tokens", "64", "--output-len", "4", "--qps", "0",
            "--num-trajectories", "2"]
    with StubServer(connector=True) as stub, StubServer() as plain:
        ran = CliRunner().invoke(main, ["replay", "--method", "fullshared", "--base-url", stub.base_url, *args,
                                        "--result-dir", str(tmp_path / "fs")])
        bare = CliRunner().invoke(main, ["replay", "--method", "nonshared", "--base-url", plain.base_url, *args,
                                         "--result-dir", str(tmp_path / "ns")])
        assert ran.exit_code == 0 and bare.exit_code == 0, ran.output + bare.output
        assert stub.rpc_calls.count("kvbench_memory") == 2  # reset at the start, read at the end
    summary = json.loads((tmp_path / "fs" / run_files.SUMMARY).read_text())
    parts = summary["memory_parts_gib"]
    assert parts["model_weights"] == 3 / 1024 and parts["kv_pool"] == 5 / 1024  # the stub's stand-in sizes
    assert parts["store"] == summary["method_store_peak_bytes"] / 2**30 > 0
    assert summary["peak_cpu_tensor_memory_gib"] == pytest.approx(sum(parts.values()))
    assert summary["peak_gpu_memory_gib"] is None
    plain_summary = json.loads((tmp_path / "ns" / run_files.SUMMARY).read_text())
    assert plain_summary["peak_cpu_tensor_memory_gib"] is None and plain_summary["memory_parts_gib"] is None


def test_a_summary_after_lost_method_stats_counts_them_and_keeps_the_reuse_share(tmp_path: Path) -> None:
    """Issue 66: after a full disk cut a run short before it copied the stats in, `summarize` said
    reuse_share 0.251 (truth about 0.75) and method_stats_missing 0 with 16 of 24 requests without
    stats. Lost stats are counted, and the reuse share is over the requests that have them."""
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "fullshared", run)
    truth = summarize_run(run)
    requests = pd.read_parquet(run / run_files.REQUESTS)
    lost = requests.index[requests["success"]][:16]
    failed = requests.index[requests["success"]][-1:]  # a failed request has no stats to lose
    requests.loc[failed, "success"] = False
    for column in ("reused_tokens", "recomputed_tokens", "eligible_tokens", "method_stats", "prefix_cached_tokens"):
        if column in requests:
            requests.loc[lost.union(failed), column] = None
    requests.to_parquet(run / run_files.REQUESTS)
    (run / run_files.REQUESTS_JOURNAL).unlink()  # the journal kept the records without their stats too
    summary = summarize_run(run)
    assert summary["method_stats_missing"] == 16
    assert set(summary["method_stats_missing_requests"]) == set(requests.loc[lost, "request_id"])
    kept = requests.drop(index=lost)
    kept = kept[kept["success"]]
    assert summary["reuse_share"] == pytest.approx(kept["reused_tokens"].sum() / kept["shared_tokens"].sum())
    assert abs(summary["reuse_share"] - truth["reuse_share"]) < 0.1  # not a third of it


def test_a_plain_vllm_run_has_no_stats_to_miss(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "nonshared", run)
    assert summarize_run(run)["method_stats_missing"] == 0
