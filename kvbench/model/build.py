"""Build the embedded model: corpus -> tokenizer -> Llama config -> short training -> bf16 weights."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvbench import __version__
from kvbench.model.corpus import stdlib_corpus
from kvbench.model.spec import BUILD_RECIPE_VERSION, TinyModelSpec
from kvbench.model.store import MANIFEST_NAME
from kvbench.model.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, save_hf_tokenizer, train_tokenizer
from kvbench.model.train import train


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """Hash of tensor names, dtypes, shapes and bytes: independent of file-format metadata."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def llama_config(spec: Any, token_ids: dict[str, int], tie_word_embeddings: bool = True) -> Any:
    """The LlamaConfig of an embedded model's spec (TinyModelSpec, RecallModelSpec, RoleModelSpec:
    the architecture fields they share)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=token_ids[BOS_TOKEN],
        eos_token_id=token_ids[EOS_TOKEN],
        pad_token_id=token_ids[PAD_TOKEN],
        torch_dtype="bfloat16",
    )


def save_model_dir(model: torch.nn.Module, tokenizer: Any, max_positions: int, out_dir: Path,
                   manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the model (bf16), its tokenizer and its manifest into `out_dir` atomically (a temp
    dir renamed into place); the manifest gains the weights' and every file's sha256."""
    model = model.to(torch.bfloat16)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)
    model.save_pretrained(str(tmp_dir), safe_serialization=True)
    save_hf_tokenizer(tokenizer, tmp_dir, max_positions)
    for path in tmp_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600: the files are meant to be shared and shipped
    # Hash what was saved: save_pretrained drops a tied lm_head, state_dict() has it.
    manifest = {**manifest, "weights_sha256": weights_sha256(load_file(str(tmp_dir / "model.safetensors")))}
    manifest["files_sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                for p in sorted(tmp_dir.iterdir()) if p.is_file()}
    (tmp_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp_dir, out_dir)
    return manifest


def build_model(spec: TinyModelSpec, seed: int, out_dir: Path, show_progress: bool = True) -> dict[str, Any]:
    """Build into `out_dir` atomically and return the manifest (also written beside the weights)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(spec.torch_threads)
    try:
        corpus = stdlib_corpus()
        tokenizer = train_tokenizer(corpus.documents, spec.vocab_size)
        vocab = tokenizer.get_vocab()
        eos_id = vocab[EOS_TOKEN]
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(list(corpus.documents)):
            ids.extend(encoding.ids)
            ids.append(eos_id)
        token_ids = torch.tensor(ids, dtype=torch.long)

        torch.manual_seed(seed)
        config = llama_config(spec, vocab)
        model = LlamaForCausalLM(config)
        num_params = sum(p.numel() for p in model.parameters())

        progress = Progress(
            TextColumn("training embedded model"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
            disable=not show_progress, transient=True,
        )
        with progress:
            task = progress.add_task("train", total=spec.train_steps, loss=float("nan"))
            result = train(
                model, token_ids, spec, seed,
                on_step=lambda step, loss: progress.update(task, completed=step + 1, loss=loss),
            )

        return save_model_dir(model, tokenizer, spec.max_position_embeddings, out_dir, {
            "name": out_dir.name,
            "seed": seed,
            "recipe_version": BUILD_RECIPE_VERSION,
            "spec": spec.to_dict(),
            "num_parameters": num_params,
            "corpus": {"source": "python-stdlib", "python": platform.python_version(),
                       "files": len(corpus.files), "bytes": corpus.num_bytes, "sha256": corpus.sha256,
                       "tokens": len(token_ids)},
            "train_seconds": round(result.train_seconds, 2),
            "train_tokens": result.train_tokens,
            "final_train_loss": round(result.final_train_loss, 4),
            "heldout_loss": round(result.heldout_loss, 4),
            "kvbench_version": __version__,
            "torch_version": torch.__version__,
        })
    finally:
        torch.set_num_threads(previous_threads)
