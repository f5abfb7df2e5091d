"""Quality against a reference run: the per-turn comparison, PGR, and the replay modes behind them
(reference-anchored, drop-shared), against the stub server (no engine)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.analysis.quality import (
    compare_outputs,
    first_divergence,
    first_token_kl,
    pgr_figures,
    quality_figures,
    token_f1,
)
from kvbench.cli import main
from kvbench.replay.stub import StubServer

SMALL = ["--shared-tokens", "64", "--output-len", "4", "--qps", "0", "--num-trajectories", "3"]


def test_token_f1_and_first_divergence_on_hand_made_outputs() -> None:
    assert token_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_f1([1, 2, 3], [4, 5, 6]) == 0.0
    assert token_f1([1, 1, 2], [1, 2, 2]) == pytest.approx(2 / 3)  # bags: {1, 2} in common, not {1, 1, 2, 2}
    assert token_f1([], []) == 1.0 and token_f1([], [1]) == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_first_token_kl_over_the_shared_top_k_and_the_rest() -> None:
    import math as m

    reference = {"token_id:1": m.log(0.6), "token_id:2": m.log(0.3)}  # the rest: 0.1
    assert first_token_kl(reference, dict(reference)) == pytest.approx(0.0, abs=1e-12)
    shifted = {"token_id:1": m.log(0.3), "token_id:2": m.log(0.6)}
    expected = 0.6 * m.log(0.6 / 0.3) + 0.3 * m.log(0.3 / 0.6)  # the rest bucket: 0.1 on both sides
    assert first_token_kl(reference, shifted) == pytest.approx(expected)
    # Nothing in common: the method's unlisted 0.1 is shared by tokens 1, 2 and the rest bucket,
    # which also holds its token 7.
    disjoint = {"token_id:7": m.log(0.9)}
    share = 0.1 / 3
    expected = 0.6 * m.log(0.6 / share) + 0.3 * m.log(0.3 / share) + 0.1 * m.log(0.1 / (0.9 + share))
    assert first_token_kl(reference, disjoint) == pytest.approx(expected)
    assert first_token_kl(reference, disjoint) > first_token_kl(reference, shifted) > 0


def _requests(outputs: dict[tuple[str, str], list[int] | None]) -> pd.DataFrame:
    return pd.DataFrame([{"trajectory_id": t, "turn_id": turn, "agent": turn.split(".")[0], "success": out is not None,
                          "reusable_tokens": 0 if turn.startswith("A0") else 10, "output_token_ids": out}
                         for (t, turn), out in outputs.items()])


def test_compare_outputs_scores_failures_as_wrong_and_splits_reuse_turns() -> None:
    reference = _requests({("t0", "A0.r0"): [1, 2, 3, 4], ("t0", "A1.r0"): [5, 6, 7, 8], ("t1", "A0.r0"): [9, 9]})
    run = _requests({("t0", "A0.r0"): [1, 2, 3, 4], ("t0", "A1.r0"): [5, 6, 0, 0], ("t1", "A0.r0"): None,
                     ("t2", "A0.r0"): [1]})  # t2: the reference lacks it, not compared
    quality = compare_outputs(run, reference).set_index(["trajectory_id", "turn_id"])
    assert len(quality) == 3
    assert quality.loc[("t0", "A0.r0"), "exact_match"] and quality.loc[("t0", "A0.r0"), "first_divergence"] == 4
    assert not quality.loc[("t0", "A1.r0"), "exact_match"] and quality.loc[("t0", "A1.r0"), "first_divergence"] == 2
    assert quality.loc[("t0", "A1.r0"), "token_f1"] == pytest.approx(0.5)
    failed = quality.loc[("t1", "A0.r0")]
    assert not failed["success"] and not failed["exact_match"] and failed["token_f1"] == 0.0
    figures = quality_figures(quality.reset_index())
    assert figures["exact_match_rate"] == pytest.approx(1 / 3)
    assert figures["exact_match_rate_reuse"] == 0.0 and figures["exact_match_rate_first"] == 0.5


def test_pgr_is_one_at_the_reference_zero_at_the_floor_and_undefined_without_a_gap() -> None:
    reference = _requests({(f"t{i}", "A1.r0"): [i, i + 1, i + 2, i + 3] for i in range(8)})
    same = compare_outputs(reference, reference)
    floor = compare_outputs(_requests({(f"t{i}", "A1.r0"): [100, 101, i, 102] for i in range(8)}), reference)
    half = compare_outputs(_requests({(f"t{i}", "A1.r0"): [i, i + 1, 100, 101] for i in range(8)}), reference)
    assert pgr_figures(same, floor)["output_pgr"] == pytest.approx(1.0)
    assert pgr_figures(floor, floor)["output_pgr"] == pytest.approx(0.0)
    figures = pgr_figures(half, floor)  # F1 0.5 against a floor of 0.25: a third of the gap
    assert figures["output_pgr"] == pytest.approx((0.5 - 0.25) / 0.75)
    assert figures["output_pgr_low"] <= figures["output_pgr"] <= figures["output_pgr_high"]
    undefined = pgr_figures(same, same)
    assert math.isnan(undefined["output_pgr"]) and "not above the floor" in undefined["output_pgr_reason"]


def _replay(stub: StubServer, out: Path, model: Path, *args: str):
    return CliRunner().invoke(main, ["replay", "--model", str(model), "--base-url", stub.base_url, *SMALL,
                                     "--save-prompt-ids", "--result-dir", str(out), *args], prog_name="kvbench")


def test_reference_anchored_and_drop_shared_replays(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """A replay anchored on a NonShared reference sends the reference's prompts and matches its
    outputs (exact match 1, PGR 1); a --drop-shared run leaves the shared segments out and is
    PGR's floor (PGR 0)."""
    with StubServer() as stub:
        assert _replay(stub, tmp_path / "ref", tiny_tokenizer_dir, "--logprobs", "5").exit_code == 0
        anchored = _replay(stub, tmp_path / "anchored", tiny_tokenizer_dir, "--reference", str(tmp_path / "ref"))
        assert anchored.exit_code == 0, anchored.output
        floor = _replay(stub, tmp_path / "floor", tiny_tokenizer_dir, "--drop-shared")
        assert floor.exit_code == 0, floor.output
    ref = pd.read_parquet(tmp_path / "ref" / "requests.parquet").set_index(["trajectory_id", "turn_id"])
    run = pd.read_parquet(tmp_path / "anchored" / "requests.parquet").set_index(["trajectory_id", "turn_id"])
    for key in ref.index:
        assert list(run.loc[key, "prompt_token_ids"]) == list(ref.loc[key, "prompt_token_ids"])
    summary = json.loads((tmp_path / "anchored" / "summary.json").read_text())
    assert summary["exact_match_rate"] == 1.0 and summary["mean_token_f1"] == 1.0
    assert summary["top1_agreement"] == 1.0 and summary["mean_first_token_kl"] == pytest.approx(0.0, abs=1e-9)
    assert summary["config"]["logprobs"] == 20  # asked for by default with --reference
    assert json.loads(run["first_token_logprobs"].iloc[0])  # recorded per request
    assert summary["config"]["prompt_mode"] == "reference"
    assert summary["config"]["reference_run"]["path"] == str(tmp_path / "ref")
    dropped = pd.read_parquet(tmp_path / "floor" / "requests.parquet").set_index(["trajectory_id", "turn_id"])
    # Every shared segment (the query, the upstream outputs) left out, nothing else.
    assert (dropped["prompt_tokens"] == ref["prompt_tokens"] - ref["shared_tokens"]).all()
    result = CliRunner().invoke(main, ["quality", str(tmp_path / "anchored"), str(tmp_path / "floor"), "--reference",
                                       str(tmp_path / "ref"), "--floor", str(tmp_path / "floor")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "anchored" / "summary.json").read_text())["output_pgr"] == pytest.approx(1.0)
    floor_summary = json.loads((tmp_path / "floor" / "summary.json").read_text())
    assert floor_summary["output_pgr"] == pytest.approx(0.0) and floor_summary["mean_token_f1"] < 1.0
    assert "output PGR (token F1) 1.000" in result.output


def test_the_papers_protocol_sends_max_tokens_1_on_the_references_prompts(tiny_tokenizer_dir: Path,
                                                                          tmp_path: Path) -> None:
    """--protocol paper (Appendix B.4): every prompt token-identical to the reference's, every
    request asking for one token; its outputs compared with the reference's first tokens."""
    with StubServer() as stub:
        assert _replay(stub, tmp_path / "ref", tiny_tokenizer_dir).exit_code == 0
        reference_requests = set(stub.bodies)
        paper = _replay(stub, tmp_path / "paper", tiny_tokenizer_dir, "--protocol", "paper", "--reference",
                        str(tmp_path / "ref"))
        assert paper.exit_code == 0, paper.output
        sent = [body for request_id, body in stub.bodies.items() if request_id not in reference_requests]
        unanchored = _replay(stub, tmp_path / "x", tiny_tokenizer_dir, "--protocol", "paper")
        assert unanchored.exit_code == 2 and "give --reference RUN_DIR" in unanchored.output
        contradicting = _replay(stub, tmp_path / "y", tiny_tokenizer_dir, "--protocol", "free", "--reference",
                                str(tmp_path / "ref"))
        assert contradicting.exit_code == 2 and "--protocol free" in contradicting.output
        resumed = _replay(stub, tmp_path / "paper", tiny_tokenizer_dir, "--reference", str(tmp_path / "ref"),
                          "--resume")  # under paper-decode, --reference's default
        assert resumed.exit_code == 1 and "under --protocol paper, not paper-decode" in resumed.output
    assert sent and all(body["max_tokens"] == 1 for body in sent)
    assert {body["max_tokens"] for request_id, body in stub.bodies.items() if request_id in reference_requests} == {4}
    ref = pd.read_parquet(tmp_path / "ref" / "requests.parquet").set_index(["trajectory_id", "turn_id"])
    run = pd.read_parquet(tmp_path / "paper" / "requests.parquet").set_index(["trajectory_id", "turn_id"])
    assert len(run) == len(ref) and (run["output_tokens"] == 1).all()
    for key in ref.index:
        assert list(run.loc[key, "prompt_token_ids"]) == list(ref.loc[key, "prompt_token_ids"])
    summary = json.loads((tmp_path / "paper" / "summary.json").read_text())
    assert summary["config"]["protocol"] == "paper" and summary["exact_match_rate"] == 1.0  # first tokens agree


def test_a_reference_of_another_trace_or_method_is_refused(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer() as stub:
        assert _replay(stub, tmp_path / "ref", tiny_tokenizer_dir).exit_code == 0
        other = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--base-url", stub.base_url,
                                          "--shared-tokens", "32", "--output-len", "4", "--qps", "0",
                                          "--num-trajectories", "3", "--result-dir", str(tmp_path / "other"),
                                          "--reference", str(tmp_path / "ref")], prog_name="kvbench")
        assert other.exit_code == 2 and "replayed another trace" in other.output
        assert not (tmp_path / "other").exists()  # refused before anything ran
        shutil.copytree(tmp_path / "ref", tmp_path / "fs")
        config = json.loads((tmp_path / "fs" / "config.json").read_text())
        (tmp_path / "fs" / "config.json").write_text(json.dumps({**config, "method": "fullshared"}))
        wrong = _replay(stub, tmp_path / "x", tiny_tokenizer_dir, "--reference", str(tmp_path / "fs"))
        assert wrong.exit_code == 2 and "a reference must be a NonShared run" in wrong.output
        both = _replay(stub, tmp_path / "y", tiny_tokenizer_dir, "--reference", str(tmp_path / "ref"), "--drop-shared")
        assert both.exit_code == 2 and "not both" in both.output
    refused = CliRunner().invoke(main, ["quality", str(tmp_path / "ref"), "--reference", str(tmp_path / "fs")])
    assert refused.exit_code == 1 and "free-running NonShared run" in refused.output


def test_pgr_interval_resamples_the_three_scores_together() -> None:
    """A paired bootstrap, checked by hand: the method recovers exactly half of every trajectory's
    own gap (floors and oracles differ per trajectory), so every paired resample's PGR is 0.5 and
    the interval is [0.5, 0.5]. Resampling the method apart from its floor and oracle would mix
    trajectories and widen it."""
    from kvbench.analysis.quality import pgr_from_scores

    ids = [f"t{i}" for i in range(8)]
    floor = pd.Series([0.0, 0.1, 0.2, 0.05, 0.3, 0.0, 0.15, 0.25], index=ids)
    oracle = pd.Series([1.0, 0.6, 0.9, 0.4, 1.0, 0.8, 0.55, 0.95], index=ids)
    method = floor + 0.5 * (oracle - floor)
    figures = pgr_from_scores(method, floor, oracle)
    assert figures["pgr"] == pytest.approx(0.5)
    assert figures["pgr_low"] == pytest.approx(0.5) and figures["pgr_high"] == pytest.approx(0.5)


def test_pgr_gain_over_naive_reuse_and_over_a_task_score() -> None:
    from kvbench.analysis.quality import pgr_from_scores

    ids = [f"t{i}" for i in range(12)]
    floor = pd.Series(0.2, index=ids)
    naive = pd.Series([0.5 + 0.01 * i for i in range(12)], index=ids)
    better = naive + 0.2
    figures = pgr_from_scores(better, floor, None, naive)
    assert figures["pgr_naive"] == pytest.approx((naive.mean() - 0.2) / 0.8)
    assert figures["pgr_gain_over_naive"] == pytest.approx(0.2 / 0.8)
    assert figures["pgr_gain_low"] > 0 and figures["pgr_gain_p_value"] < 0.01
    same = pgr_from_scores(naive, floor, None, naive)
    assert same["pgr_gain_over_naive"] == 0.0 and same["pgr_gain_p_value"] == 1.0
    # A task score: the oracle is the reference's own accuracy, not 1.
    oracle = pd.Series([1.0] * 9 + [0.0] * 3, index=ids)
    task = pgr_from_scores(pd.Series([1.0] * 6 + [0.0] * 6, index=ids), pd.Series(0.0, index=ids), oracle)
    assert task["pgr"] == pytest.approx(0.5 / 0.75) and task["pgr_oracle_score"] == 0.75


def test_figures_written_before_the_renaming_are_read_under_the_new_names() -> None:
    """Old quality_pgr.json files and summaries (no pgr_schema) called the token-F1 PGR `pgr` and
    the task's `pgr_task`: read now, they are `output_pgr` and `pgr`."""
    from kvbench.analysis.quality import PGR_SCHEMA, renamed_pgr_keys

    old = {"pgr": 0.6, "pgr_low": 0.5, "pgr_reason": None, "pgr_task": 0.8, "pgr_task_high": 0.9, "mean_token_f1": 0.7}
    assert renamed_pgr_keys(old) == {"output_pgr": 0.6, "output_pgr_low": 0.5, "output_pgr_reason": None, "pgr": 0.8,
                                     "pgr_high": 0.9, "mean_token_f1": 0.7, "pgr_schema": PGR_SCHEMA}
    new = {"pgr": 0.8, "output_pgr": 0.6, "pgr_schema": PGR_SCHEMA}
    assert renamed_pgr_keys(new) == new and renamed_pgr_keys({"completed": 3}) == {"completed": 3}


def test_one_embedded_model_is_the_same_model_wherever_it_lies(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Runs of the shipped model from two checkouts (another worktree, another machine) compare:
    a model is its name and weights digest, not its path; other weights are refused."""
    from kvbench.model.store import MANIFEST_NAME, default_model_dir, model_identity
    from kvbench.replay.reference import ReferenceRunError, check_comparable

    manifest = json.loads((default_model_dir() / MANIFEST_NAME).read_text())
    for checkout, digest in (("a", manifest["weights_sha256"]), ("b", manifest["weights_sha256"]), ("c", "0" * 64)):
        (tmp_path / checkout / "recall-v1").mkdir(parents=True)
        (tmp_path / checkout / "recall-v1" / MANIFEST_NAME).write_text(json.dumps({**manifest, "weights_sha256": digest}))
    assert model_identity(str(tmp_path / "a" / "recall-v1")) == model_identity(str(default_model_dir()))
    assert model_identity("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    with StubServer() as stub:
        assert _replay(stub, tmp_path / "ref", tiny_tokenizer_dir).exit_code == 0
    recorded = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert recorded["model_identity"] == model_identity(str(tiny_tokenizer_dir))  # recorded with the run
    shutil.copytree(tmp_path / "ref", tmp_path / "run")

    def record(run: str, **keys: str | None) -> None:
        config = json.loads((tmp_path / run / "config.json").read_text())
        (tmp_path / run / "config.json").write_text(json.dumps({**config, **keys}))

    # runs recorded before the identity was: read from the path, where it still lies
    record("ref", model=str(tmp_path / "a" / "recall-v1"), model_identity=None)
    record("run", model=str(tmp_path / "b" / "recall-v1"), model_identity=None)
    check_comparable(tmp_path / "run", tmp_path / "ref")  # same weights, other path: comparable
    record("run", model=str(tmp_path / "c" / "recall-v1"))
    with pytest.raises(ReferenceRunError, match="ran model"):
        check_comparable(tmp_path / "run", tmp_path / "ref")
    # recorded identities still compare after the weights' folders are gone
    record("ref", model="/gone/a", model_identity=model_identity(str(tmp_path / "a" / "recall-v1")))
    record("run", model="/gone/b", model_identity=model_identity(str(tmp_path / "b" / "recall-v1")))
    check_comparable(tmp_path / "run", tmp_path / "ref")
