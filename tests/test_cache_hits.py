"""Cache hits where users look for them (issue 51 item 4): vLLM's prefix-cache hit share and the
method's reuse share in the live progress line, summary.json, the console summary and the report."""

from __future__ import annotations

from kvbench.analysis.summary import cache_hit_figures
from kvbench.replay.progress import ReplayProgress
from kvbench.replay.server_metrics import MetricsSampler


def test_the_prefix_cache_hit_share_is_over_the_run_and_every_server() -> None:
    sampler = MetricsSampler(["a", "b"], {})
    sampler.samples = [
        {"server_url": "a", "vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 1000.0},
        {"server_url": "b", "vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0},
        {"server_url": "a", "vllm:prefix_cache_hits_total": 400.0, "vllm:prefix_cache_queries_total": 2000.0},
        {"server_url": "b", "vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 1000.0},
        {"server_url": "b", "process_tree_rss_bytes": 5},  # a sample without vLLM's counters is skipped
    ]
    assert sampler.prefix_cache_hit_share() == (300 + 100) / (1000 + 1000)
    assert MetricsSampler(["a"], {}).prefix_cache_hit_share() is None  # nothing sampled yet


def test_the_live_reuse_share_is_over_the_shared_tokens_finished() -> None:
    reused = {"n": 0}
    progress = ReplayProgress("fullshared", 3, enabled=False, reused_tokens=lambda: reused["n"])
    assert progress.reuse_share() is None  # nothing finished
    progress.add(True, 10.0, shared_tokens=100)
    progress.add(False, None, shared_tokens=500)  # a failed request's shared tokens are not counted
    progress.add(True, 12.0, shared_tokens=300)
    reused["n"] = 300
    assert progress.reuse_share() == 300 / 400
    assert ReplayProgress("nonshared", 1, enabled=False).reuse_share() is None  # plain vLLM reports none


def test_summary_hit_figures() -> None:
    assert cache_hit_figures({"prefix_cache_hits": 50, "prefix_cache_queries": 200, "reused_tokens": 30,
                              "shared_tokens": 120}) == {"prefix_cache_hit_share": 0.25, "reuse_share": 0.25}
    assert cache_hit_figures({"prefix_cache_hits": None, "prefix_cache_queries": None, "reused_tokens": None,
                              "shared_tokens": 0}) == {"prefix_cache_hit_share": None, "reuse_share": None}
