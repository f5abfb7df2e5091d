"""Cache hits where users look for them (issue 51 item 4): vLLM's prefix-cache hit share and the
method's reuse share in the live progress line, summary.json, the console summary and the report."""

from __future__ import annotations

from paths import DATA

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


def test_a_cold_start_is_named_on_screen() -> None:
    import json

    import pandas as pd

    from kvbench.analysis.metrics import cold_start_share
    from kvbench.cli.replay import cold_start_warning

    decisions = [{"decision": "dense_few_anchors"}, {"decision": "dense_few_anchors"}, {"decision": "accepted"},
                 {"decision": "dense_gate"}]
    requests = pd.DataFrame({"method_stats": [json.dumps({"decisions": decisions[:2]}), json.dumps({"decisions": decisions[2:]}),
                                              None]})
    assert cold_start_share(requests) == 0.5
    assert cold_start_share(pd.DataFrame({"method_stats": [json.dumps({"reused_tokens": 4})]})) is None  # no decisions
    warning = cold_start_warning({"cold_start_dense_share": 0.5, "realized_rho": 0.33, "config": {}})
    assert warning is not None and "50% of the method's segment decisions" in warning and "0.33" in warning
    assert "--prime-method-state" in warning
    assert cold_start_warning({"cold_start_dense_share": 0.1, "config": {}}) is None
    assert cold_start_warning({"cold_start_dense_share": None}) is None


def test_the_warm_up_advice_follows_from_the_run_not_the_flags_given() -> None:
    """Issue 68: a run given --num-warmups 2 --prime-method-state was told to pass them. The advice
    counts the measured trajectories whose decisions still went dense for want of anchors."""
    import json

    import pandas as pd

    from kvbench.analysis.metrics import cold_start_trajectories
    from kvbench.cli.replay import cold_start_warning

    def stats(*kinds: str) -> str:
        return json.dumps({"decisions": [{"decision": kind} for kind in kinds]})

    requests = pd.DataFrame({"trajectory_id": ["t0", "t0", "t1", "t1", "t2", "t2"],
                             "scheduled_ns": [1, 2, 3, 4, 5, 6],
                             "method_stats": [stats("dense_few_anchors"), None, stats("accepted", "dense_few_anchors"),
                                              stats("dense_gate"), stats("accepted"), stats("accepted")]})
    assert cold_start_trajectories(requests) == 2  # t1's decisions were the last to find the pool empty
    assert cold_start_trajectories(requests.iloc[4:]) == 0
    assert cold_start_trajectories(requests.assign(method_stats=None)) is None
    config = {"num_warmups": 2, "prime_method_state": True}
    primed = cold_start_warning({"cold_start_dense_share": 0.5, "cold_start_trajectories": 2, "config": config})
    assert primed is not None and "even after 2 primed warm-ups" in primed and "--num-warmups 4 measures" in primed
    assert "--prime-method-state" not in primed  # given already
    cold = cold_start_warning({"cold_start_dense_share": 0.5, "cold_start_trajectories": 3, "config": {}})
    assert cold is not None and "--num-warmups 3 --prime-method-state" in cold


def test_a_run_and_its_reference_that_differ_besides_the_method_are_named() -> None:
    """Issue 51: a compiled run compared with an eager reference, or one under load with a QPS 0
    reference, compares more than the method."""
    from kvbench.replay.reference import comparison_caveats, numeric_flags

    eager = ["python", "-m", "vllm", "--model", "m", "--port", "1", "--enforce-eager", "--max-num-seqs", "8"]
    compiled = ["python", "-m", "vllm", "--model", "m", "--port", "2", "--max-num-seqs=8"]
    assert numeric_flags(eager) == {"--enforce-eager": "", "--max-num-seqs": "8"}
    assert numeric_flags(compiled) == {"--max-num-seqs": "8"} and numeric_flags(None) is None
    same = {"server_command": eager, "request_rate": 0.0, "vllm_version": "0.32.0"}
    assert comparison_caveats(same, {**same, "server_command": eager[:5] + ["9"] + eager[6:]}) == []  # the port aside
    caveats = comparison_caveats({"server_command": compiled, "request_rate": 8.0, "vllm_version": "0.32.0"}, same)
    assert len(caveats) == 2
    assert "--enforce-eager" in caveats[0] and "QPS 8, the reference at 0" in caveats[1]
    assert comparison_caveats({"request_rate": 0.0}, {"request_rate": 0.0}) == []  # servers the user ran: unknown


def test_a_leaderboard_without_nonshared_says_why_ttft_saved_is_empty(tmp_path) -> None:

    from click.testing import CliRunner

    from kvbench.cli import main

    golden = DATA / "golden-runs"
    result = CliRunner().invoke(main, ["leaderboard", str(golden / "fullshared"), "-o", str(tmp_path / "lb")])
    assert result.exit_code == 0, result.output
    assert "`ttft_saved` is empty for" in result.output and "add `nonshared`" in result.output
    with_base = CliRunner().invoke(main, ["leaderboard", str(golden), "-o", str(tmp_path / "lb2")])
    assert with_base.exit_code == 0 and "`ttft_saved` is empty" not in with_base.output


def test_a_quality_sweep_adds_the_nonshared_cells(tmp_path, monkeypatch, tiny_tokenizer_dir) -> None:
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.experiment import sweep_runner

    seen = {}
    monkeypatch.setattr(sweep_runner, "run_sweep", lambda spec, out, *rest: seen.setdefault("spec", spec))
    result = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "s"), "--methods", "kvcmas", "--quality",
                                       "--shared-tokens", "64", "--qps", "0,2", "--output-len", "4", "--model",
                                       str(tiny_tokenizer_dir)])
    assert result.exit_code == 0, result.output
    assert [m.name for m in seen["spec"].methods] == ["nonshared", "kvcmas"] and "adds nonshared" in result.output


def test_table7_cells_far_from_the_papers_rho_are_flagged() -> None:
    import pandas as pd

    from kvbench.analysis.paper.serving import rho_far_from_paper

    frame = pd.DataFrame({"method": ["nonshared", "fullshared", "kvcmas", "kvcmas"],
                          "method_config": ["nonshared", "fullshared", "kvcmas", "kvcmas"],
                          "shared_tokens": [2048] * 4, "qps": [0.0, 0.0, 0.0, 8.0],
                          "realized_rho": [float("nan"), 1.0, 0.82, 0.0]})
    (line, _) = rho_far_from_paper(frame)
    assert "kvcmas ctx=2048 qps=8 (rho 0.00)" in line and "qps=0 (rho 0.82)" not in line
    assert "fullshared" not in line and "nonshared" not in line
    assert rho_far_from_paper(frame.iloc[:3]) == []
