"""The kvbench connector inside a real vLLM server (CPU backend): numerical checks of reuse,
re-alignment, the partial forward, cache isolation, preemption and the dense fallback."""

from __future__ import annotations

import json
import math
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.contracts import CONTRACT_VERSION, Plan
from kvbench.replay.server import VLLMServer
from kvbench.replay.worker_rpc import WorkerClient
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tokenizer import load_tokenizer

pytestmark = pytest.mark.engine

@pytest.fixture(scope="module")
def server(fullshared_server: VLLMServer) -> VLLMServer:
    return fullshared_server


@pytest.fixture(scope="module")
def prompts(default_model: str) -> dict[str, list[int]]:
    """A0's prompt (system + q), and A1's prompt (another system prompt, q at other positions)."""
    tokenizer = load_tokenizer(None)
    _, (trajectory,) = generate_trace(TraceSpec(shared_tokens=1500, num_trajectories=1, seed=42), tokenizer)
    q = tokenizer.encode(trajectory.shared["q"].text)
    sys0 = tokenizer.encode(trajectory.agents["A0"].system)
    sys1 = tokenizer.encode(trajectory.agents["A1"].system)
    tail = tokenizer.encode("\n\nA: ")
    return {"sys0": sys0, "sys1": sys1, "q": q, "tail": tail, "p0": sys0 + q + tail, "p1": sys1 + q + tail}


def _key() -> str:
    return uuid.uuid4().hex[:12]


def _complete(server: VLLMServer, prompt: list[int], plan: dict | None = None, salt: str | None = None,
              max_tokens: int = 1) -> dict:
    body: dict = {"model": server.config.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True, "logprobs": 20, "return_tokens_as_token_ids": True}
    if plan is not None:
        body["kv_transfer_params"] = Plan.from_dict({**plan, "version": CONTRACT_VERSION}).to_params()
    if salt is not None:
        body["cache_salt"] = salt
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]


def _logprobs(choice: dict) -> dict[int, float]:
    return {int(k.split(":")[1]): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}


def _max_dlogprob(a: dict, b: dict) -> float:
    la, lb = _logprobs(a), _logprobs(b)
    return max(abs(la[t] - lb[t]) for t in set(la) & set(lb))


@pytest.fixture(scope="module")
def bf16_noise(default_model: str, prompts: dict) -> dict[str, float]:
    """Log-prob tolerance per prompt: 0.02, or one bf16 step of the largest next-token logit if
    that is coarser. vLLM computes logits in bf16, so a single logit rounding the other way moves
    log-probs by one step: 1/32 for logits in [4, 8). (0.02 came from a random-weight model whose
    logits are small; the trained embedded model's are not.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    tolerance = {}
    for name in ("p0", "p1"):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompts[name]])).logits[0, -1]
        step = 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)
        tolerance[name] = max(0.02, step + 0.002)
    return tolerance


def _dense(server: VLLMServer, prompt: list[int], key: str, max_tokens: int = 1) -> dict:
    """vLLM's own prefill (nothing claimed), saved under `key` as the reference cache."""
    return _complete(server, prompt, {"save_as": key, "claim": False, "segments": []}, salt=key,
                     max_tokens=max_tokens)


def _reuse_q(prompts: dict, target: str, source_key: str, save_as: str, **extra) -> dict:
    """Plan for `target` ("p0"/"p1") whose q segment is reused from A0's saved cache."""
    sys_len = len(prompts["sys0"] if target == "p0" else prompts["sys1"])
    return {"save_as": save_as, "segments": [
        {"kind": "pf", "id": "system", "start": 0, "length": sys_len},
        {"kind": "ph", "id": "q", "start": sys_len, "length": len(prompts["q"]), "source": source_key,
         "source_start": len(prompts["sys0"])},
        {"kind": "pf", "id": "text", "start": sys_len + len(prompts["q"]), "length": len(prompts["tail"])}], **extra}


def _kv_error(server: VLLMServer, key: str, reference: str, start: int = 0, stop: int | None = None) -> dict:
    return WorkerClient(server.base_url).kv_error(key, reference, start, stop)[0]


def _request_stats(server: VLLMServer, key: str) -> dict:
    return dict(WorkerClient(server.base_url).stats()[0].requests[key])


def _small_replay(server: VLLMServer, method: str, result_dir: Path) -> tuple[pd.DataFrame, dict, list[dict]]:
    """`kvbench replay` of 2 four-agent trajectories (512 shared tokens, 16-token outputs) at QPS 0,
    all successful: the requests, the summary and each request's method stats."""
    result = CliRunner().invoke(main, ["replay", "--method", method, "--base-url", server.base_url, "--qps", "0",
                                       "--num-trajectories", "2", "--shared-tokens", "512", "--output-len", "16",
                                       "--result-dir", str(result_dir)], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(result_dir / "requests.parquet")
    assert requests["success"].all() and len(requests) == 8
    return (requests, json.loads((result_dir / "summary.json").read_text()),
            requests["method_stats"].map(json.loads).tolist())


def _set_params(server: VLLMServer, **params: object) -> dict:
    """Swap the server's method parameters (its learned state is dropped); returns them all."""
    return WorkerClient(server.base_url).set_params(params)


@pytest.mark.parametrize("name", ["p0", "p1"])
def test_partial_forward_of_all_tokens_matches_dense(server: VLLMServer, prompts: dict, bf16_noise: dict,
                                                     name: str) -> None:
    dense_key, pf_key = _key(), _key()
    dense = _dense(server, prompts[name], dense_key)
    computed = _complete(server, prompts[name], {"save_as": pf_key, "segments": []}, salt=pf_key)
    assert _max_dlogprob(dense, computed) <= bf16_noise[name]
    n = len(prompts[name]) - 1
    error = _kv_error(server, pf_key, dense_key, 0, n)
    assert error["same_tokens"] and error["rows"] == n
    assert all(layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01 for layer in error["layers"]), error
    stats = _request_stats(server, pf_key)
    assert stats["recomputed_tokens"] == n and stats["reused_tokens"] == 0


def test_exact_source_reuse_is_bit_identical(server: VLLMServer, prompts: dict) -> None:
    dense_key, reuse_key = _key(), _key()
    dense = _dense(server, prompts["p0"], dense_key)
    n = len(prompts["p0"]) - 1
    plan = {"save_as": reuse_key, "segments": [
        {"kind": "ph", "id": "all", "start": 0, "length": n, "source": dense_key, "source_start": 0}]}
    reused = _complete(server, prompts["p0"], plan, salt=reuse_key)
    assert _max_dlogprob(dense, reused) <= 0.02
    assert _kv_error(server, reuse_key, dense_key, 0, n)["bit_identical"]
    assert _request_stats(server, reuse_key)["reused_tokens"] == n


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 steps (8 significant bits) at the magnitude of each rotated pair: RoPE turns
    (x_i, x_{i+d/2}) as a 2-vector (neox style), so rounding error scales with the pair's norm,
    not with an element that happens to land near zero."""
    x1, x2 = b.chunk(2, dim=-1)
    pair_norm = torch.sqrt(x1 * x1 + x2 * x2).repeat(1, 1, 2).clamp_min(2.0 ** -10)
    spacing = torch.exp2(torch.floor(torch.log2(pair_norm)) - 7)
    return (a - b).abs() / spacing


def test_rope_realignment_of_layer0_keys(server: VLLMServer, prompts: dict) -> None:
    source_key, target_key, dense_key = _key(), _key(), _key()
    _dense(server, prompts["p0"], source_key)
    _complete(server, prompts["p1"], _reuse_q(prompts, "p1", source_key, target_key), salt=target_key)
    _dense(server, prompts["p1"], dense_key)
    s0, s1, rows = len(prompts["sys0"]), len(prompts["sys1"]), 256
    assert s0 != s1  # q really moved
    def rpc(key: str, start: int) -> dict:
        return WorkerClient(server.base_url).saved_rows(key, 0, start, start + rows)[0]

    realigned = torch.tensor(rpc(target_key, s1)["k"])
    fresh = torch.tensor(rpc(dense_key, s1)["k"])
    unrotated = torch.tensor(rpc(source_key, s0)["k"])
    # Layer-0 keys depend only on token and position, so re-aligned reused keys equal fresh ones.
    assert float(_ulps(realigned, fresh).max()) <= 2.0
    assert float(_ulps(unrotated, fresh).max()) > 50  # without re-rotation they do not


def test_fullshared_from_another_prefix_differs_measurably(server: VLLMServer, prompts: dict) -> None:
    source_key, target_key, dense_key, computed_key = _key(), _key(), _key(), _key()
    _dense(server, prompts["p0"], source_key)
    shared = _complete(server, prompts["p1"], _reuse_q(prompts, "p1", source_key, target_key), salt=target_key)
    dense = _dense(server, prompts["p1"], dense_key)
    computed = _complete(server, prompts["p1"], {"save_as": computed_key, "segments": []}, salt=computed_key)
    n = len(prompts["p1"]) - 1
    reuse_error = _kv_error(server, target_key, dense_key, 0, n)["layers"]
    noise = _kv_error(server, computed_key, dense_key, 0, n)["layers"]  # same path, no reuse
    assert reuse_error[0]["k_rel"] < 0.01  # layer 0 is context-free: reuse is exact up to rounding
    for layer in (-2, -1):  # deeper layers carry the other agent's prefix
        for kv in ("k_rel", "v_rel"):
            assert reuse_error[layer][kv] > 5 * noise[layer][kv], (reuse_error, noise)
    # The next-token distribution moves more than the computation noise does. Only that: how far
    # it moves is the model's business, and the embedded model reads its context weakly (issue
    # 23): on one build the shift was over 10x the noise, on this machine's build it is 2x
    # (0.031 against 0.015, one bf16 step of its logits), while the caches differ by over 5x.
    assert _max_dlogprob(dense, shared) > max(_max_dlogprob(dense, computed), 1e-3)
    assert _request_stats(server, target_key)["reused_tokens"] == len(prompts["q"])


def test_exact_request_after_approximate_is_not_contaminated(server: VLLMServer, prompts: dict) -> None:
    source_key = _key()
    _dense(server, prompts["p0"], source_key)
    n = len(prompts["p1"]) - 1

    def approximate_then_plain(prompt: list[int], salt: str | None) -> dict:
        """An approximate (FullShared) request, then plain vLLM requests for the same prompt; the
        plain one's cache is saved (claim: false) to compare it with a fresh dense prefill."""
        plan = _reuse_q({**prompts, "sys1": prompt[:len(prompts["sys1"])]}, "p1", source_key, _key())
        _complete(server, prompt, plan, salt=salt)
        dense_key, plain_key = _key(), _key()
        _dense(server, prompt, dense_key)
        _complete(server, prompt, {"save_as": plain_key, "claim": False, "segments": []})
        return _kv_error(server, plain_key, dense_key, 0, n)

    # With a salt (as the replayer sends for approximate methods) the later exact request is
    # computed afresh: its cache is the dense one.
    clean = approximate_then_plain(prompts["sys1"][:-1] + prompts["sys0"][-1:] + prompts["q"] + prompts["tail"], _key())
    assert clean["bit_identical"], clean
    # Negative control: without the salt, vLLM's prefix cache serves it the approximate blocks.
    dirty = approximate_then_plain(prompts["sys1"][:-2] + prompts["sys0"][-2:] + prompts["q"] + prompts["tail"], None)
    assert not dirty["bit_identical"] and dirty["layers"][-1]["k_rel"] > 0.01, dirty


def _metric(server: VLLMServer, name: str) -> float:
    from kvbench.replay.server_metrics import parse_metrics

    with urllib.request.urlopen(f"{server.base_url}/metrics") as response:
        return parse_metrics(response.read().decode()).get(name, 0.0)


def test_preemption_and_resume_rematerialize(server: VLLMServer, prompts: dict) -> None:
    source_key = _key()
    _dense(server, prompts["p0"], source_key)
    variants = [prompts["sys1"][:-1] + [prompts["sys1"][-1] + i] + prompts["q"] + prompts["tail"] for i in range(4)]

    def run(index: int) -> list[str]:
        prompt = variants[index]
        plan = _reuse_q({**prompts, "sys1": prompt[:len(prompts["sys1"])]}, "p1", source_key, _key())
        # 640 generated tokens: 5 more blocks each, so even if the scheduler admits only three of
        # the four at once, their growth outruns the free blocks (400 left it to timing)
        choice = _complete(server, prompt, plan, salt=_key(), max_tokens=640)
        return [next(iter(step)) for step in choice["logprobs"]["top_logprobs"]]

    alone = [run(i) for i in range(4)]  # one at a time: no preemption
    before = _metric(server, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, range(4)))  # 4 x ~2,200 tokens > FULLSHARED_BLOCKS x 128 slots
    assert _metric(server, "vllm:num_preemptions_total") > before, "the test did not cause a preemption"
    assert together == alone


def test_injected_fault_falls_back_to_dense(server: VLLMServer, prompts: dict, bf16_noise: dict) -> None:
    source_key, key = _key(), _key()
    _dense(server, prompts["p0"], source_key)
    dense = _dense(server, prompts["p1"], _key(), max_tokens=24)
    faulty = _complete(server, prompts["p1"], _reuse_q(prompts, "p1", source_key, key, inject_fault=True),
                       salt=key, max_tokens=24)
    assert faulty["text"] == dense["text"]
    assert _max_dlogprob(dense, faulty) <= bf16_noise["p1"]
    stats = _request_stats(server, key)
    assert stats["fallback"] == "dense" and "injected fault" in stats["error"]


def test_replay_stats_match_the_trace_spans(server: VLLMServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
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
