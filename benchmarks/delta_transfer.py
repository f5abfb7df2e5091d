"""How much of one agent's cross-agent KV delta can be predicted from other contents' deltas?

Delta correction (KVComm, KVCMAS) reuses agent A0's cache of a shared segment for agent A1 and
adds a correction interpolated from the deltas C_A1 - Align(C_A0) observed on *other* contents of
the same slot. This script measures, outside vLLM and for the embedded model (or any HF model
given with --model), the normalized error ||C_A1 - estimate|| / ||C_A1|| (mean over the layers whose
K/V depend on the context, kvbench.model.store.first_context_layer on, and over K and V) of the
shared query rows, leave-one-content-out over N contents, for:

  fullshared      no correction (the source cache re-aligned: A0's, as FullShared serves it, or
                  with --source reference the context-free reference)
  mean_others     the plain mean of the other contents' deltas
  anchors_r{r}    kvbench's anchor path: token-wise softmax weights over the other contents
                  (methods/delta/anchors.py, rank-r factors; what KVCMAS applies on an accepted edge)
  best_segment    least-squares weights per segment fitted on the target itself (an oracle bound
                  for any segment-wise interpolation of these deltas)
  best_token      least-squares weights per token fitted on the target (oracle bound, token-wise)

and the mean cosine similarity between different contents' deltas (last layer).

    .venv/bin/python benchmarks/delta_transfer.py [--shared-tokens 2048] [--contents 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from kvbench.methods.core.rope import RopeAligner
from kvbench.methods.delta.anchors import AnchorPool, interpolated_delta
from kvbench.model.resolve import resolve_model
from kvbench.model.store import first_context_layer
from kvbench.replay.prompts import PromptBuilder
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trajectory
from kvbench.tracegen.tokenizer import load_tokenizer


def query_rows(model: torch.nn.Module, builder: PromptBuilder, prefix: list[int], trajectory: Trajectory,
               agent: str | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V [layers, n, heads, head_dim] of the shared query rows in this agent's prompt (the
    prompt up to the end of the query: later rows cannot change them), and the query's start.
    agent=None: the context-free reference of the non-chained methods (prompt prefix + query)."""
    turn = next(t for t in trajectory.turns if agent is None or t.agent == agent)
    ids = list(prefix)
    for segment in turn.segments:
        piece = builder.segment_ids(trajectory, turn, segment, {})
        if segment.ph == "q":
            start = len(ids)
            ids += piece
            break
        if agent is not None:
            ids += piece
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0, :, start:].transpose(0, 1) for layer in cache.layers]).float()
    values = torch.stack([layer.values[0, :, start:].transpose(0, 1) for layer in cache.layers]).float()
    return keys, values, start


def flat(x: torch.Tensor) -> torch.Tensor:
    """[layers, n, heads, head_dim] -> [layers, n, features]"""
    return x.reshape(x.shape[0], x.shape[1], -1)


def relative(error: torch.Tensor, target: torch.Tensor) -> float:
    return float(error.norm() / target.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory [default: the embedded model]")
    parser.add_argument("--shared-tokens", type=int, default=2048)
    parser.add_argument("--contents", type=int, default=8, help="trajectories (distinct query contents)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--source", choices=["A0", "reference"], default="A0",
                        help="whose cache is corrected for A1: agent A0's (chained, FullShared) or the "
                             "context-free reference (prompt prefix + query; non-chained methods)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(None)
    path = Path(args.model or resolve_model(None))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    config = json.loads((path / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    aligner = RopeAligner.from_theta(head_dim, config["max_position_embeddings"], theta)
    header, trajectories = generate_trace(TraceSpec(shared_tokens=args.shared_tokens,
                                                    num_trajectories=args.contents, seed=args.seed), tokenizer)
    builder = PromptBuilder(tokenizer, header.prompt_prefix_ids, "delta-transfer")

    sources, targets = [], []  # per content: (K, V) as [layers, n, D], keys in canonical positions
    for trajectory in trajectories:
        k0, v0, start0 = query_rows(model, builder, header.prompt_prefix_ids, trajectory,
                                    "A0" if args.source == "A0" else None)
        k1, v1, start1 = query_rows(model, builder, header.prompt_prefix_ids, trajectory, "A1")
        sources.append((flat(aligner.rotate(k0, -start0)), flat(v0)))
        targets.append((flat(aligner.rotate(k1, -start1)), flat(v1)))
    deltas = [(t[0] - s[0], t[1] - s[1]) for s, t in zip(sources, targets)]
    n, layers, count = args.shared_tokens, sources[0][0].shape[0], len(sources)
    # Layers before it are context-free (layer 0; the recall model's hand-set circuit): their delta
    # is zero, and some of their values are too, so they would dilute the mean (or make it 0/0).
    measured = range(first_context_layer(path), layers)

    def error_of(estimates: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean over contents, measured layers and K/V of ||delta - estimate|| / ||target||."""
        return float(np.mean([relative(deltas[i][kv][layer] - estimates[i][kv][layer], targets[i][kv][layer])
                              for i in range(count) for kv in (0, 1) for layer in measured]))

    def others(i: int, kv: int) -> torch.Tensor:
        return torch.stack([deltas[j][kv] for j in range(count) if j != i], dim=-1)  # [layers, n, D, others]

    def least_squares(i: int, kv: int, per_token: bool) -> torch.Tensor:
        x, y = others(i, kv), deltas[i][kv]
        if per_token:
            return (x @ torch.linalg.lstsq(x, y.unsqueeze(-1)).solution).squeeze(-1)
        flat_x = x.reshape(layers, -1, count - 1)
        weights = torch.linalg.lstsq(flat_x, y.reshape(layers, -1, 1)).solution
        return (flat_x @ weights).reshape(y.shape)

    def anchors_estimate(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = AnchorPool(count)
        for j in range(count):
            if j != i:
                pool.add(f"c{j}", "A0->A1", *sources[j], *deltas[j], args.rank, args.rank, torch.bfloat16)
        dk, dv = interpolated_delta(*sources[i], pool.compatible("A0->A1", n), "A0->A1", n)
        return dk.float(), dv.float()

    results = {
        "fullshared": error_of([(torch.zeros_like(d[0]), torch.zeros_like(d[1])) for d in deltas]),
        "mean_others": error_of([(others(i, 0).mean(-1), others(i, 1).mean(-1)) for i in range(count)]),
        f"anchors_r{args.rank}": error_of([anchors_estimate(i) for i in range(count)]),
        "best_segment": error_of([(least_squares(i, 0, False), least_squares(i, 1, False)) for i in range(count)]),
        "best_token": error_of([(least_squares(i, 0, True), least_squares(i, 1, True)) for i in range(count)]),
    }
    for kv, name in ((0, "k"), (1, "v")):
        unit = torch.stack([d[kv][-1].flatten() / d[kv][-1].norm() for d in deltas])
        similarity = unit @ unit.T
        results[f"delta_cosine_{name}"] = float((similarity.sum() - count) / (count * count - count))
    print(f"model {path.name}, {n} shared tokens, {count} contents, {args.source} -> A1, {args.dtype}, "
          f"layers {measured.start}-{layers - 1}")
    for name, value in results.items():
        ratio = f" ({value / results['fullshared']:.2f} x fullshared)" if not name.startswith("delta_cosine") else ""
        print(f"{name:16s} {value:.4f}{ratio}")


if __name__ == "__main__":
    main()
