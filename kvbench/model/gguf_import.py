"""Real models from GGUF files: transformers' GGUF loader dequantizes them, and the result is
written as a bf16 folder vLLM serves (safetensors, tokenizer, chat template, manifest).

Only architectures whose decoder layers the connector's partial forward follows (the Llama layer:
methods/core/forward.py) are taken; any other is refused with what the connector lacks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.model.store import MANIFEST_NAME

# GGUF `general.architecture` values the connector runs: Llama's decoder layer (RMSNorm, rotary
# attention with grouped KV heads, SiLU-gated MLP), which its partial forward re-implements.
SUPPORTED_ARCHITECTURES = ("llama",)
# What the connector lacks for architectures users are likely to try (any other: "not a Llama
# decoder layer"). Said at import, before minutes of conversion.
UNSUPPORTED_REASONS = {
    "gemma3": "sliding-window attention in 5 of every 6 layers (the connector's attention is global), q/k "
              "RMSNorm inside attention and norms after each block (its partial forward follows Llama's layer)",
    "gemma2": "sliding-window attention in every other layer and logit soft-capping (the connector's attention "
              "is global and uncapped), norms after each block",
    "qwen3": "q/k RMSNorm inside attention (the connector's partial forward follows Llama's layer)",
    "phi3": "fused gate/up projections under other names and partial rotary embeddings",
}
GGUF_EXTRA_HINT = "pip install 'kvbench[gguf]' (the gguf and accelerate packages transformers' GGUF loader needs)"


class UnsupportedModelError(ValueError):
    """A GGUF file of an architecture the connector cannot run."""


class ModelDigestError(ValueError):
    """A conversion whose weights are not the ones pinned for that model."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file (its metadata only is read)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError(f"reading a GGUF file needs the gguf package: {GGUF_EXTRA_HINT}") from None
    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (KeyError, ValueError, IndexError, OSError) as exc:
        raise ValueError(f"{path} is not a GGUF file kvbench can read ({type(exc).__name__}: {exc})") from None


def check_supported(architecture: str) -> None:
    if architecture in SUPPORTED_ARCHITECTURES:
        return
    reason = UNSUPPORTED_REASONS.get(architecture, "its decoder layers are not the Llama layer the connector's "
                                                   "partial forward follows (methods/core/forward.py)")
    raise UnsupportedModelError(f"GGUF architecture {architecture!r} is not supported: {reason}. Supported: "
                                f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def convert_gguf(gguf_path: Path, out_dir: Path, name: str, source: dict[str, Any],
                 expected_weights_sha256: str | None = None) -> dict[str, Any]:
    """Convert `gguf_path` into `out_dir` (atomically: a temp folder renamed into place) and return
    its manifest. `source` says where the file came from (recorded); a conversion whose weights
    digest differs from `expected_weights_sha256` is refused and nothing is written."""
    architecture = gguf_architecture(gguf_path)
    check_supported(architecture)
    try:
        import accelerate  # noqa: F401 - transformers' GGUF loading path imports it lazily
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils.quantization_config import GgufConfig
    except ImportError as exc:
        raise ImportError(f"converting a GGUF file needs {exc.name}: {GGUF_EXTRA_HINT}") from None
    from transformers.utils import logging as hf_logging

    from kvbench.model.build import weights_sha256

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # kvbench says what it does; the loader's bars would repeat it
    folder, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    # dequantize: every weight unpacked into a plain bf16 model (vLLM serves that; it cannot
    # serve transformers' packed GGUF modules, and those are not serializable)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # type: ignore[assignment]  # (not serializable while it is set)
    max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_positions:
        tokenizer.model_max_length = max_positions  # the GGUF tokenizer says "unbounded"

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)
        model.save_pretrained(str(tmp_dir))
        tokenizer.save_pretrained(str(tmp_dir))
        for path in tmp_dir.iterdir():
            path.chmod(0o644)  # safetensors writes 0600: the folder is shared with servers and workers
        from safetensors.torch import load_file

        digest = weights_sha256(load_file(str(tmp_dir / "model.safetensors")))
        if expected_weights_sha256 is not None and digest != expected_weights_sha256:
            raise ModelDigestError(f"{name}: the converted weights' sha256 is {digest}, not the pinned "
                                   f"{expected_weights_sha256}; refusing it (another file, or a transformers/gguf "
                                   "release that dequantizes differently)")
        config = model.config
        manifest = {
            "name": name,
            "origin": "gguf",
            "constructed": False,
            "source": source,
            "architecture": architecture,
            "num_hidden_layers": config.num_hidden_layers,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "max_position_embeddings": max_positions or None,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "weights_sha256": digest,
            "kvbench_version": __version__,
            "torch_version": torch.__version__,
            "transformers_version": _version("transformers"),
            "gguf_version": _version("gguf"),
        }
        manifest["files_sha256"] = {p.name: file_sha256(p) for p in sorted(tmp_dir.iterdir()) if p.is_file()}
        (tmp_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
