"""Build the recall model: package corpus -> tokenizer -> Llama with the constructed retrieval
circuit (kvbench.model.circuit) -> long-context curriculum on natural text and task text, every
weight trained except the circuit's -> bf16 weights with a manifest.

Resumable: a checkpoint is written every `checkpoint_every` steps beside the output directory and
picked up by the next run with the same spec and seed.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvbench import __version__
from kvbench.model import circuit
from kvbench.model.corpus import package_corpus, read_corpus_files
from kvbench.model.spec import spec_digest
from kvbench.model.store import cache_root
from kvbench.model.tokenizer import EOS_TOKEN, train_tokenizer
from kvbench.model.train import evaluate, warmup_cosine
from kvbench.model.vocabulary import ARROW, NAME_WORDS, RECALL_ANSWER_PREFIX

RECALL_RECIPE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RecallModelSpec:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64  # 32 RoPE pairs: 16 fast ones locate, the 8 slowest match content
    max_position_embeddings: int = 65536
    # The 8 slowest of 32 pairs turn by < 0.2 rad over 32K tokens: content matches at any distance.
    rope_theta: float = 1e7
    # Curriculum: (window tokens, sequences per step, steps): local structure first in short windows,
    # then most tokens (3.6M of 4.4M) in 2K-8K windows, the last phase at 8K.
    curriculum: tuple[tuple[int, int, int], ...] = ((512, 16, 100), (2048, 4, 300), (4096, 2, 80), (8192, 1, 60))
    # Share of sequences that are recall-format documents (tables, question, answer) drawn from a
    # training stream of their own (gen-trace's evaluation traces come from other seeds).
    task_share: float = 0.1
    embedding_std: float = 1.0  # of the trained part's embedding dims
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    torch_threads: int = 2
    checkpoint_every: int = 50

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return spec_digest(self, RECALL_RECIPE_VERSION)

    @property
    def total_steps(self) -> int:
        return sum(steps for _, _, steps in self.curriculum)


def recall_model_dir(spec: RecallModelSpec, seed: int) -> Path:
    """Where `kvbench model build --recipe recall` writes (the shipped copy lives in the package)."""
    return cache_root() / "models" / f"recall-llama-{spec.digest()}-seed{seed}"


def recall_circuit_spec(tokenizer: Any) -> circuit.CircuitSpec:
    """The prompt facts the circuit needs, measured with the model's own tokenizer."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    names = {}
    for word in NAME_WORDS:
        line, space = ids(word), ids(" " + word)
        if len(line) != 1 or len(space) != 1:
            raise ValueError(f"name word {word!r} is not one token in both forms ({line}, {space})")
        names[word] = (line[0], space[0])
    (newline,), (colon,), arrow = ids("\n"), ids(":"), ids(ARROW.rstrip())
    if len(arrow) != 1:
        raise ValueError(f"{ARROW.rstrip()!r} is not one token: {arrow}")
    return circuit.CircuitSpec(question_tokens=len(ids(RECALL_ANSWER_PREFIX)),
                               name_token_ids=names, newline_id=newline, arrow_id=arrow[0], colon_id=colon)


def task_document(rng: random.Random, lines: int) -> str:
    """A recall-format text (tool output, table, question, answer) from the training stream."""
    def name() -> str:
        return f"{rng.choice(NAME_WORDS)} {rng.choice(NAME_WORDS)}"

    table = {name(): name() for _ in range(lines)}
    start = rng.choice(list(table))
    body = "".join(f"\n{a}{ARROW}{b}" for a, b in table.items())
    return f"Tool output (forwarding table).{body}\n\nStart from {start}.{RECALL_ANSWER_PREFIX}{table[start]}\n"


def _batches(spec: RecallModelSpec, train_ids: torch.Tensor, tokenizer: Any, seed: int):
    """(step, batch) for every step of the curriculum, reproducible from the seed alone."""
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(f"recall-train-{seed}")  # the evaluation traces use gen-trace's own seeds
    eos = tokenizer.token_to_id(EOS_TOKEN)
    step = 0
    for window, per_step, steps in spec.curriculum:
        for _ in range(steps):
            rows = []
            for _ in range(per_step):
                if rng.random() < spec.task_share:
                    ids: list[int] = []
                    while len(ids) < window:
                        ids += tokenizer.encode(task_document(rng, rng.randint(20, window // 14))).ids + [eos]
                    rows.append(torch.tensor(ids[:window]))
                else:
                    start = int(torch.randint(0, len(train_ids) - window - 1, (1,), generator=generator))
                    rows.append(train_ids[start:start + window])
            yield step, torch.stack(rows)
            step += 1


@torch.no_grad()
def calibrate_norms(model: torch.nn.Module, frozen: circuit.FrozenParams, samples: list[torch.Tensor]) -> dict[str, float]:
    """Set the circuit dims of every RMSNorm weight to the median RMS of that norm's input, so the
    circuit reads its fields at their written size after training moved the rest of the stream."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    lay = circuit.Layout(model.config.hidden_size)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, LlamaRMSNorm):
            def hook(mod: torch.nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                seen.setdefault(name, []).append(args[0].float().pow(2).mean(-1).sqrt().flatten())
            handles.append(module.register_forward_pre_hook(hook))
    try:
        for ids in samples:
            model(input_ids=ids[None])
    finally:
        for handle in handles:
            handle.remove()
    scales = {}
    for name, values in seen.items():
        scale = float(torch.cat(values).median())
        param = f"{name}.weight"
        dict(model.named_parameters())[param][lay.start:] = scale
        frozen.values[param][lay.start:] = scale
        scales[name] = round(scale, 4)
    return scales


def heldout_loss(model: torch.nn.Module, tokenizer: Any, documents: list[str], window: int = 2048,
                 windows: int = 8) -> float:
    """Mean next-token loss (nats) over the first `windows` windows of the held-out files, joined."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids += encoding.ids
        if len(ids) >= window * windows:
            break
    return evaluate(model, torch.tensor(ids), window, max_windows=windows)


def build_recall_model(spec: RecallModelSpec, seed: int, out_dir: Path,
                       on_step: Callable[[int, int, float, float], None] | None = None) -> dict[str, Any]:
    """Build into `out_dir` atomically; returns the manifest. `on_step(step, total, loss, tokens_per_s)`."""
    from transformers import LlamaForCausalLM

    from kvbench.model.build import llama_config, save_model_dir

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(spec.torch_threads)
    try:
        corpus = package_corpus()
        task_rng = random.Random(f"recall-tokenizer-{seed}")
        task_docs = [task_document(task_rng, 40) for _ in range(2000)]
        tokenizer = train_tokenizer(list(corpus.train.documents) + task_docs, spec.vocab_size)
        vocab = tokenizer.get_vocab()
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(list(corpus.train.documents)):
            ids += encoding.ids + [vocab[EOS_TOKEN]]
        train_ids = torch.tensor(ids, dtype=torch.long)

        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama_config(spec, vocab, tie_word_embeddings=False))
        residual_rms = circuit.ONE / 16  # the circuit's constant dominates the stream's RMS
        frozen = circuit.install(model, recall_circuit_spec(tokenizer), norm_scale=residual_rms)
        with torch.no_grad():
            # The trained part starts at the scale RMSNorm would give it without the circuit: unit
            # embeddings, and norm weights that undo the constant's share of the RMS. (At the usual
            # 0.02 it would read its inputs 100x too small, and learn that slowly.)
            trained = slice(0, circuit.Layout(spec.hidden_size).start)
            model.model.embed_tokens.weight[:, trained].normal_(0.0, spec.embedding_std)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param[trained] = residual_rms
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=spec.weight_decay,
                                      betas=(0.9, 0.95))

        checkpoint = out_dir.parent / f".{out_dir.name}.checkpoint.pt"
        first_step, train_seconds, losses = 0, 0.0, []
        if checkpoint.exists():
            state = torch.load(checkpoint, weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first_step, train_seconds, losses = state["step"], state["train_seconds"], state["losses"]
        model.train()
        tokens_seen = 0
        for step, batch in _batches(spec, train_ids, tokenizer, seed):
            if step < first_step:
                continue
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(step, spec.learning_rate, spec.warmup_steps, spec.total_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            frozen.zero_grads(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            frozen.restore(model)
            elapsed = time.perf_counter() - started
            train_seconds += elapsed
            tokens_seen += batch.numel()
            losses = (losses + [loss.item()])[-20:]
            if on_step is not None:
                on_step(step, spec.total_steps, losses[-1], batch.numel() / elapsed)
            if (step + 1) % spec.checkpoint_every == 0:
                out_dir.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                            "train_seconds": train_seconds, "losses": losses}, checkpoint)

        model.eval()
        sample_rng = random.Random(f"recall-calibration-{seed}")
        samples = [torch.tensor(tokenizer.encode(task_document(sample_rng, 150)).ids) for _ in range(2)]
        samples.append(train_ids[:4096])
        norm_scales = calibrate_norms(model, frozen, samples)
        frozen.restore(model)
        held_out = heldout_loss(model, tokenizer, read_corpus_files(corpus.heldout_files))
        manifest = save_model_dir(model, tokenizer, spec.max_position_embeddings, out_dir, {
            "name": out_dir.name,
            "recipe": "recall",
            "seed": seed,
            "recipe_version": RECALL_RECIPE_VERSION,
            "spec": spec.to_dict(),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "corpus": {"source": "python-stdlib+packages", "python": platform.python_version(),
                       "files": len(corpus.train.files), "bytes": corpus.train.num_bytes,
                       "sha256": corpus.train.sha256, "tokens": len(train_ids)},
            "heldout_files": list(corpus.heldout_files),
            "circuit": {"layers": [0, 1, 2], "width": circuit.Layout(spec.hidden_size).width,
                        "norm_scales": norm_scales},
            "train_seconds": round(train_seconds, 1),
            "train_tokens": sum(w * n * s for w, n, s in spec.curriculum),
            "final_train_loss": round(sum(losses) / max(1, len(losses)), 4),
            "heldout_loss": round(held_out, 4),
            "kvbench_version": __version__,
            "torch_version": torch.__version__,
            "torch_threads": spec.torch_threads,
        })
        checkpoint.unlink(missing_ok=True)
        return manifest
    finally:
        torch.set_num_threads(previous_threads)
