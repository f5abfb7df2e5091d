"""The kvbench connector inside a real vLLM server (CPU backend): numerical checks of reuse,
re-alignment, the partial forward, cache isolation, preemption and the dense fallback."""

from __future__ import annotations

import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from vllm_helpers import complete, dense_prefill, kv_error, max_dlogprob, new_key, request_stats, reuse_q

from kvbench.cli import main
from kvbench.experiment.invariants import rope_ulps
from kvbench.server.lifecycle import VLLMServer
from kvbench.server.worker_rpc import WorkerClient

pytestmark = pytest.mark.engine

@pytest.fixture(scope="module")
def server(fullshared_server: VLLMServer) -> VLLMServer:
    return fullshared_server


@pytest.mark.parametrize("name", ["p0", "p1"])
def test_partial_forward_of_all_tokens_matches_dense(server: VLLMServer, prompts: dict, bf16_noise: dict,
                                                     name: str) -> None:
    dense_key, pf_key = new_key(), new_key()
    dense = dense_prefill(server, prompts[name], dense_key)
    computed = complete(server, prompts[name], {"save_as": pf_key, "claim": "all", "segments": []}, salt=pf_key)
    assert max_dlogprob(dense, computed) <= bf16_noise[name]
    n = len(prompts[name]) - 1
    error = kv_error(server, pf_key, dense_key, 0, n)
    assert error["same_tokens"] and error["rows"] == n
    assert all(layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01 for layer in error["layers"]), error
    stats = request_stats(server, pf_key)
    assert stats["recomputed_tokens"] == n and stats["reused_tokens"] == 0


def test_exact_source_reuse_is_bit_identical(server: VLLMServer, prompts: dict, bf16_noise: dict) -> None:
    dense_key, reuse_key = new_key(), new_key()
    dense = dense_prefill(server, prompts["p0"], dense_key)
    n = len(prompts["p0"]) - 1
    plan = {"save_as": reuse_key, "segments": [
        {"kind": "ph", "id": "all", "start": 0, "length": n, "source": dense_key, "source_start": 0}]}
    reused = complete(server, prompts["p0"], plan, salt=reuse_key)
    assert max_dlogprob(dense, reused) <= bf16_noise["p0"]  # the last row alone: another GEMM shape
    assert kv_error(server, reuse_key, dense_key, 0, n)["bit_identical"]
    stats = request_stats(server, reuse_key)
    # Whole blocks of the dense source are copied as its exact prefix, the rest reused (bit-identical too)
    assert stats["exact_prefix_tokens"] > 0 and stats["reused_tokens"] > 0
    assert stats["exact_prefix_tokens"] + stats["reused_tokens"] == n


def test_rope_realignment_of_layer0_keys(server: VLLMServer, prompts: dict) -> None:
    source_key, target_key, dense_key = new_key(), new_key(), new_key()
    dense_prefill(server, prompts["p0"], source_key)
    complete(server, prompts["p1"], reuse_q(prompts, "p1", source_key, target_key), salt=target_key)
    dense_prefill(server, prompts["p1"], dense_key)
    s0, s1, rows = len(prompts["sys0"]), len(prompts["sys1"]), 256
    assert s0 != s1  # q really moved
    def rpc(key: str, start: int) -> dict:
        return WorkerClient(server.base_url).saved_rows(key, 0, start, start + rows)[0]

    realigned, fresh, unrotated = rpc(target_key, s1)["k"], rpc(dense_key, s1)["k"], rpc(source_key, s0)["k"]
    # Layer-0 keys depend only on token and position, so re-aligned reused keys equal fresh ones
    # (in bf16 steps at each rotated pair's magnitude: kvbench check's measure).
    assert rope_ulps(realigned, fresh, "bfloat16") <= 2.0
    assert rope_ulps(unrotated, fresh, "bfloat16") > 50  # without re-rotation they do not


def test_fullshared_from_another_prefix_differs_measurably(server: VLLMServer, prompts: dict) -> None:
    source_key, target_key, dense_key, computed_key = new_key(), new_key(), new_key(), new_key()
    dense_prefill(server, prompts["p0"], source_key)
    complete(server, prompts["p1"], reuse_q(prompts, "p1", source_key, target_key), salt=target_key)
    dense_prefill(server, prompts["p1"], dense_key)
    complete(server, prompts["p1"], {"save_as": computed_key, "claim": "all", "segments": []}, salt=computed_key)
    n = len(prompts["p1"]) - 1
    reuse_error = kv_error(server, target_key, dense_key, 0, n)["layers"]
    noise = kv_error(server, computed_key, dense_key, 0, n)["layers"]  # same path, no reuse
    assert reuse_error[0]["k_rel"] < 0.01  # layer 0 is context-free: reuse is exact up to rounding
    for layer in (-2, -1):  # deeper layers carry the other agent's prefix
        for kv in ("k_rel", "v_rel"):
            assert reuse_error[layer][kv] > 2 * noise[layer][kv], (reuse_error, noise)
    # Not asserted: that the next-token distribution moves more than the computation noise. On the
    # embedded model (it reads its context weakly, issue 23) the shift is about one bf16 step of its
    # logits (0.031), the same step a rounding flip on the computed path gives (seen at 0.015 and at
    # 0.033 on two builds): below the resolution of the logprobs vLLM returns. What reuse costs in
    # outputs is measured where the model's construction makes it visible (test_role_models_vllm.py).
    assert request_stats(server, target_key)["reused_tokens"] == len(prompts["q"])


def test_a_later_round_copies_its_own_earlier_prompt_exactly(server: VLLMServer, prompts: dict, bf16_noise: dict) -> None:
    """A first turn reuses nothing: vLLM prefills it (not claimed) and it is saved, exact. A later
    turn of the same agent starts with that prompt and its output: the connector copies those rows
    (whole blocks) from the saved cache as vLLM's prefix cache would, instead of computing the role
    prompt again behind its cache_salt, and the result is the dense one."""
    sys_len, q_len = len(prompts["sys0"]), len(prompts["q"])
    first_key, dense_key, later_key = new_key(), new_key(), new_key()
    first = complete(server, prompts["p0"], {"save_as": first_key, "segments": [
        {"kind": "pf", "id": "system", "start": 0, "length": sys_len},
        {"kind": "ph", "id": "q", "start": sys_len, "length": q_len}]}, salt=first_key, max_tokens=4)
    assert request_stats(server, first_key)["claimed"] is False
    output = [int(t.split(":")[1]) for t in first["logprobs"]["tokens"]][:3]  # the last has no K/V
    later_prompt = prompts["p0"] + output + prompts["tail"]
    plan = {"save_as": later_key, "segments": [
        {"kind": "pf", "id": "system", "start": 0, "length": sys_len},
        {"kind": "ph", "id": "q", "start": sys_len, "length": q_len, "source": first_key, "source_start": sys_len},
        {"kind": "ph", "id": "out:A0.r0", "start": len(prompts["p0"]), "length": 3, "source": first_key,
         "source_start": len(prompts["p0"])},
        {"kind": "pf", "id": "text", "start": len(prompts["p0"]) + 3, "length": len(prompts["tail"])}]}
    dense = dense_prefill(server, later_prompt, dense_key)
    later = complete(server, later_prompt, plan, salt=later_key)
    stats = request_stats(server, later_key)
    common = len(prompts["p0"]) + 3
    assert 0 < stats["exact_prefix_tokens"] <= common < stats["exact_prefix_tokens"] + 1024  # whole blocks of it
    assert stats["local_tokens"] == 0  # its salt keeps vLLM's own prefix cache out
    assert stats["exact_prefix_tokens"] + stats["reused_tokens"] + stats["recomputed_tokens"] == len(later_prompt) - 1
    assert max_dlogprob(dense, later) <= bf16_noise["p0"]
    error = kv_error(server, later_key, dense_key, 0, stats["exact_prefix_tokens"])
    assert all(layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01 for layer in error["layers"]), error


def test_exact_request_after_approximate_is_not_contaminated(server: VLLMServer, prompts: dict) -> None:
    source_key = new_key()
    dense_prefill(server, prompts["p0"], source_key)
    n = len(prompts["p1"]) - 1

    def approximate_then_plain(prompt: list[int], salt: str | None) -> dict:
        """An approximate (FullShared) request, then plain vLLM requests for the same prompt; the
        plain one's cache is saved (claim: false) to compare it with a fresh dense prefill."""
        plan = reuse_q({**prompts, "sys1": prompt[:len(prompts["sys1"])]}, "p1", source_key, new_key())
        complete(server, prompt, plan, salt=salt)
        dense_key, plain_key = new_key(), new_key()
        dense_prefill(server, prompt, dense_key)
        complete(server, prompt, {"save_as": plain_key, "claim": "none", "segments": []})
        return kv_error(server, plain_key, dense_key, 0, n)

    # With a salt (as the replayer sends for approximate methods) the later exact request is
    # computed afresh: its cache is the dense one.
    clean = approximate_then_plain(prompts["sys1"][:-1] + prompts["sys0"][-1:] + prompts["q"] + prompts["tail"], new_key())
    assert clean["bit_identical"], clean
    # Negative control: without the salt, vLLM's prefix cache serves it the approximate blocks.
    dirty = approximate_then_plain(prompts["sys1"][:-2] + prompts["sys0"][-2:] + prompts["q"] + prompts["tail"], None)
    assert not dirty["bit_identical"] and dirty["layers"][-1]["k_rel"] > 0.01, dirty


def _metric(server: VLLMServer, name: str) -> float:
    from kvbench.replay.server_metrics import parse_metrics

    with urllib.request.urlopen(f"{server.base_url}/metrics") as response:
        return parse_metrics(response.read().decode()).get(name, 0.0)


def test_preemption_and_resume_rematerialize(server: VLLMServer, prompts: dict, bf16_noise: dict) -> None:
    source_key = new_key()
    dense_prefill(server, prompts["p0"], source_key)
    variants = [prompts["sys1"][:-1] + [prompts["sys1"][-1] + i] + prompts["q"] + prompts["tail"] for i in range(4)]

    def run(index: int) -> list[dict[str, float]]:
        """The top-20 log-probs of each generated token, greedy."""
        prompt = variants[index]
        plan = reuse_q({**prompts, "sys1": prompt[:len(prompts["sys1"])]}, "p1", source_key, new_key())
        # 640 generated tokens: 5 more blocks each, so even if the scheduler admits only three of
        # the four at once, their growth outruns the free blocks (400 left it to timing)
        return complete(server, prompt, plan, salt=new_key(), max_tokens=640)["logprobs"]["top_logprobs"]

    alone = [run(i) for i in range(4)]  # one at a time: no preemption
    before = _metric(server, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, range(4)))  # 4 x ~2,200 tokens > FULLSHARED_BLOCKS x 128 slots
    assert _metric(server, "vllm:num_preemptions_total") > before, "the test did not cause a preemption"
    # Batched, the same greedy decode: the same tokens with the same log-probs up to bf16 rounding
    # (batching changes GEMM shapes), until a near-tie may break the other way. A cache lost or
    # misplaced on resume would change a token that wins clearly.
    tolerance = 2 * max(bf16_noise.values())
    for steps_alone, steps_together in zip(alone, together, strict=True):
        for step, (a, b) in enumerate(zip(steps_alone, steps_together, strict=True)):
            top_a, top_b = max(a, key=a.__getitem__), max(b, key=b.__getitem__)
            if top_a != top_b:
                assert top_b in a and a[top_a] - a[top_b] <= tolerance, (step, a, b)
                break  # a near-tie: the two decodes continue from different tokens
            assert abs(a[top_a] - b[top_b]) <= tolerance, (step, a, b)


def test_injected_fault_falls_back_to_dense(server: VLLMServer, prompts: dict, bf16_noise: dict) -> None:
    source_key, key = new_key(), new_key()
    dense_prefill(server, prompts["p0"], source_key)
    dense = dense_prefill(server, prompts["p1"], new_key(), max_tokens=24)
    faulty = complete(server, prompts["p1"], reuse_q(prompts, "p1", source_key, key, inject_fault=True),
                       salt=key, max_tokens=24)
    assert faulty["text"] == dense["text"]
    assert max_dlogprob(dense, faulty) <= bf16_noise["p1"]
    stats = request_stats(server, key)
    assert stats["fallback"] == "dense" and "injected fault" in stats["error"]


def _kvbench_metrics(server: VLLMServer) -> dict[str, float]:
    """The connector's `vllm:kvbench_*` series on the server's /metrics (summed over engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvbench_") and not sample.name.endswith("_created"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_replay_stats_match_the_trace_spans(server: VLLMServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
    before = _kvbench_metrics(server)
    result = CliRunner().invoke(main, ["replay", "--method", "fullshared", "--base-url", server.base_url, "--qps", "0",
                                       "--num-trajectories", "2", "--shared-tokens", "700", "--output-len", "12",
                                       "--result-dir", str(out)], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet")
    assert requests["success"].all()
    for _, row in requests.iterrows():
        # Every reusable PH token is reused: the replayer counts as reusable exactly the rows a
        # source holds with K/V (not an output's last token in its producer's own cache).
        assert row["reused_tokens"] == row["reusable_tokens"]
        assert row["recomputed_tokens"] + row["reused_tokens"] == row["prompt_tokens"] - 1
        if row["turn_id"] != "A0.r0":  # later turns: every PH row but each producer's own last token
            stats = json.loads(row["method_stats"])
            from_producer = sum(1 for s in stats["segments"]
                                if s["id"].startswith("out:") and s["source"].endswith("/" + s["id"][4:]))
            assert row["reusable_tokens"] == row["shared_tokens"] - from_producer
    summary = json.loads((out / "summary.json").read_text())
    first = requests["turn_id"] == "A0.r0"
    assert requests.loc[first, "reused_tokens"].eq(0).all()
    # FullShared serves every token a source holds: realized rho is 1.
    assert (requests["eligible_tokens"] == requests["reused_tokens"]).all()
    assert math.isclose(summary["realized_rho"], 1.0)
    assert summary["method_store_peak_bytes"] > 0
    # The same totals on vLLM's own stats path: /metrics, as a Prometheus user of the server sees them
    after = _kvbench_metrics(server)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["vllm:kvbench_requests_total"] == len(requests)
    assert grew["vllm:kvbench_reused_tokens_total"] == requests["reused_tokens"].sum() > 0
    assert grew["vllm:kvbench_recomputed_tokens_total"] == requests["recomputed_tokens"].sum()
    assert grew["vllm:kvbench_saves_total"] == len(requests) - 2  # each trajectory's last agent is not kept
    assert after["vllm:kvbench_store_bytes"] > 0


@pytest.mark.parametrize("concurrent", [True, False])
def test_agents_reading_one_document_in_parallel_reuse_the_first_ones_prompt(server: VLLMServer, tmp_path: Path,
                                                                               concurrent: bool) -> None:
    """A fan-in's first agents read the same query at the same time: with concurrent sources the
    later ones reuse the first one's prompt as soon as it is computed, while it still decodes (item 7
    of issue 51); without, each prefills it."""
    out, trace = tmp_path / "run", tmp_path / "fan-in.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--workflow", "fan-in", "--agents", "4",
                                     "--num-trajectories", "2", "--shared-tokens", "700", "--output-len", "24"])
    assert made.exit_code == 0, made.output
    flag = "--concurrent-sources" if concurrent else "--no-concurrent-sources"
    result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", "fullshared", "--base-url",
                                       server.base_url, "--qps", "0", "--num-warmups", "0", flag,
                                       "--result-dir", str(out)], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet").set_index(["trajectory_id", "turn_id"])
    assert requests["success"].all()
    for trajectory, turns in requests.groupby(level="trajectory_id"):
        turns = turns.droplevel(0)
        readers = turns.loc[["A1.r0", "A2.r0"]]
        if not concurrent:
            assert (readers["reused_tokens"] == 0).all() and (readers["reusable_tokens"] == 0).all()
            continue
        assert (readers["reused_tokens"] == readers["reusable_tokens"]).all() and (readers["reused_tokens"] > 600).all()
        # They went ahead once A0's prompt was saved, while A0 was still decoding its 24 tokens.
        assert (readers["first_token_ns"] < turns.loc["A0.r0", "end_ns"]).all(), trajectory
        source = json.loads(turns.loc["A0.r0", "method_stats"])
        assert source.get("prompt_save_s", 0) > 0
