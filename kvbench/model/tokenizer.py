"""The embedded model's own byte-level BPE tokenizer, trained with Hugging Face `tokenizers`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) so that any text, not just Python, round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json, loadable by AutoTokenizer and vLLM."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    # transformers 5 writes its new class name; the classic alias loads in transformers 4 and 5.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
