"""`kvbench model check`: the realism figures of a model, what real LLMs show beside each.

Offline (transformers): held-out loss by position bucket, attention sinks at 8K, effective rank of
cross-agent value deltas. Serving (vLLM, two sweeps through the experiment driver): recall-task
accuracy under NonShared and FullShared, the variety of generated outputs, KVComm's and KVCMAS's
corrected KV error against FullShared's, and the prefill time of an 8K prompt.
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.model.store import MANIFEST_NAME


@dataclass(frozen=True)
class CheckSettings:
    model: str | None = None
    device: str = "cpu"
    loss_window: int = 8192  # tokens per held-out window (32768 reaches the last bucket)
    loss_windows: int = 2
    sink_window: int = 8192
    delta_tokens: int = 8192  # shared tokens of the trajectories whose cross-agent deltas are measured
    delta_trajectories: int = 2
    recall_contexts: tuple[int, ...] = (2048, 8192)
    recall_trajectories: int = 16
    generation_tokens: int = 32
    serving_context: int = 8192
    serving_trajectories: int = 4
    seed: int = 0


def offline_figures(settings: CheckSettings, on_step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvbench.model.realism import (
        attention_sink_probe,
        effective_rank,
        heldout_documents,
        heldout_windows,
        loss_by_position,
        shared_rows_values,
        token_losses,
    )
    from kvbench.model.resolve import resolve_model
    from kvbench.model.store import first_context_layer
    from kvbench.replay.prompts import PromptBuilder
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    path = resolve_model(settings.model)
    tokenizer = load_tokenizer(settings.model)
    dtype = torch.float32 if settings.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(settings.device).eval()
    manifest_path = Path(path) / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    documents = heldout_documents(manifest)

    on_step("held-out loss by position")
    windows = heldout_windows(tokenizer, documents, settings.loss_window, settings.loss_windows)
    losses = [token_losses(model, window) for window in windows]
    by_position = loss_by_position(losses)

    on_step(f"attention sinks at {settings.sink_window}")
    sink_window = heldout_windows(tokenizer, documents, settings.sink_window, 1)[0]
    with attention_sink_probe(model) as sinks:
        token_losses(model, sink_window)
    layers = sorted(sinks)
    later = layers[len(layers) // 2:]

    on_step(f"cross-agent value deltas at {settings.delta_tokens}")
    _, trajectories = generate_trace(TraceSpec(shared_tokens=settings.delta_tokens, output_len=1,
                                               num_trajectories=settings.delta_trajectories, seed=settings.seed),
                                     tokenizer)
    ranks, relative = [], []
    builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id="model-check")
    for trajectory in trajectories:
        spans = {}
        for turn in trajectory.turns[:2]:  # A0 and A1: the first edge
            ids = list(tokenizer.prompt_prefix_ids)
            for segment in turn.segments:
                piece = builder.segment_ids(trajectory, turn, segment, {})
                if segment.ph == "q":
                    spans[turn.agent] = (ids + piece, len(ids), len(ids) + len(piece))
                    break
                ids += piece
        (p0, s0, e0), (p1, s1, e1) = spans["A0"], spans["A1"]
        v0, v1 = shared_rows_values(model, p0, s0, e0), shared_rows_values(model, p1, s1, e1)
        for layer in range(first_context_layer(path), v0.shape[0]):  # earlier layers: no delta
            delta = v1[layer] - v0[layer]
            ranks.append(effective_rank(delta))
            relative.append(float(delta.norm() / v1[layer].norm()))
    head_dims = v0.shape[-1]
    return {
        "heldout_loss_by_position": by_position,
        "heldout_tokens": sum(len(w) for w in windows),
        "attention_sink_share_by_layer": {str(k): round(sinks[k], 4) for k in layers},
        "attention_sink_share_later_layers": sum(sinks[k] for k in later) / len(later),
        "value_delta_effective_rank_90": sum(ranks) / len(ranks),
        "value_delta_dims": head_dims,
        "value_delta_relative_norm": sum(relative) / len(relative),
    }


def serving_figures(settings: CheckSettings, root: Path, on_step: Callable[[str], None] = lambda _: None
                    ) -> dict[str, Any]:
    from kvbench.experiment.kv_errors import read_kv_errors, record_kv_errors
    from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
    from kvbench.experiment.sweep_runner import run_sweep
    from kvbench.model.realism import repeated_ngram_share
    from kvbench.tracegen.tasks.recall import recall_output_len
    from kvbench.tracegen.tokenizer import load_tokenizer

    on_step("recall accuracy (NonShared, FullShared)")
    answer_tokens = recall_output_len(load_tokenizer(settings.model).encode)
    recall = SweepSpec(methods=[MethodConfig("nonshared"), MethodConfig("fullshared")], task="recall",
                       points=[SweepPoint(c, 0.0, settings.recall_trajectories) for c in settings.recall_contexts],
                       output_len=answer_tokens, num_warmups=1, seed=settings.seed, model=settings.model)
    accuracy: dict[str, dict[str, float]] = {}
    for cell in run_sweep(recall, root / "recall", on_cell=on_step):
        summary = json.loads((cell.path / run_files.SUMMARY).read_text())
        accuracy.setdefault(cell.method.name, {})[str(cell.shared_tokens)] = summary.get("task_accuracy", math.nan)

    on_step(f"generation, KV error and prefill at {settings.serving_context}")
    serving = SweepSpec(methods=[MethodConfig("nonshared"), MethodConfig("fullshared"), MethodConfig("kvcomm", {"V": 10}),
                                 MethodConfig("kvcmas")],
                        points=[SweepPoint(settings.serving_context, 0.0, settings.serving_trajectories)],
                        output_len=settings.generation_tokens, num_warmups=3, prime_method_state=True,
                        save_prompt_ids=True, seed=settings.seed, model=settings.model)
    cells = run_sweep(serving, root / "serving", on_cell=on_step, after_cell=record_kv_errors(2))
    errors = {c.method.method: kept["kv_error"] for c in cells if (kept := read_kv_errors(c)) is not None}
    dense = pd.read_parquet(next(c for c in cells if c.method.method == "nonshared").path / run_files.REQUESTS)
    outputs = [tuple(ids) for ids in dense.loc[dense["success"], "output_token_ids"]]
    first_turns = dense[dense["turn_id"] == "A0.r0"]
    fullshared_error = errors.get("fullshared", math.nan)
    return {
        "recall_accuracy": accuracy,
        "recall_gap_8k": accuracy.get("nonshared", {}).get("8192", math.nan)
        - accuracy.get("fullshared", {}).get("8192", math.nan),
        "outputs": len(outputs),
        "distinct_output_share": len(set(outputs)) / len(outputs) if outputs else math.nan,
        "single_token_output_share": sum(len(set(o)) == 1 for o in outputs) / len(outputs) if outputs else math.nan,
        "repeated_4gram_share": float(pd.Series([repeated_ngram_share(o) for o in outputs]).mean()),
        "kv_error": errors,
        "kv_error_over_fullshared": {m: e / fullshared_error for m, e in errors.items() if m != "fullshared"},
        "prefill_ms": float(first_turns["ttft_ms"].median()),
        "prefill_tokens": int(first_turns["prompt_tokens"].median()),
    }


def run_check(settings: CheckSettings, root: Path, serving: bool = True,
              on_step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The realism figures of a model, or for a role-family model what reuse costs on it
    (kvbench.experiment.family_check); written to root/check.json."""
    from kvbench.model.resolve import resolve_model
    from kvbench.model.role_build import family_of

    path = resolve_model(settings.model)
    manifest_path = Path(path) / MANIFEST_NAME
    figures: dict[str, Any] = {
        "model": Path(path).name if settings.model is None else settings.model,
        "weights_sha256": json.loads(manifest_path.read_text()).get("weights_sha256") if manifest_path.exists() else None,
        "machine": f"{platform.node()} ({platform.machine()})",
    }
    family = family_of(path)
    if family is not None:
        from kvbench.experiment.family_check import (
            FamilyCheckSettings,
            offline_family_figures,
            serving_family_figures,
        )

        family_settings = FamilyCheckSettings(model=str(settings.model), seed=settings.seed)
        on_step("dense and naively reused answers, margins, cross-role deltas")
        figures |= {"family": asdict(family), "settings": asdict(family_settings),
                    **offline_family_figures(family_settings)}
        if serving:
            on_step("task accuracy in vLLM (NonShared, FullShared)")
            figures |= serving_family_figures(family_settings, root, on_step)
    else:
        figures |= {"settings": asdict(settings), **offline_figures(settings, on_step)}
        if serving:
            figures |= serving_figures(settings, root, on_step)
    root.mkdir(parents=True, exist_ok=True)
    (root / "check.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures
