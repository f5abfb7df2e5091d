"""The recall model's constructed retrieval circuit, on an untrained Llama (no vLLM, no training):
it answers recall traces by reading the table, and training never moves what it owns."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from recall_helpers import chain_accuracy

from kvbench.model import circuit
from kvbench.model.recall_build import RecallModelSpec, recall_circuit_spec, task_document
from kvbench.tracegen.tasks.recall import NAME_WORDS


@pytest.fixture(scope="module")
def circuit_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama with the circuit installed and nothing trained, and a tokenizer learned
    from recall-format text and the role prompts (so every name word is one token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.model.tokenizer import save_hf_tokenizer, train_tokenizer
    from kvbench.tracegen.roles import ROLE_POOL

    rng = random.Random(0)
    documents = [task_document(rng, 40) for _ in range(300)] + [role.system for role in ROLE_POOL.values()]
    documents += ["Notes the team wrote so far, in order: (Table Reader) noted the tool returned"] * 50
    tokenizer = train_tokenizer(documents, vocab_size=1024)
    spec = RecallModelSpec()
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=4,
                         num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                         head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
                         rope_theta=spec.rope_theta, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    circuit.install(model, recall_circuit_spec(tokenizer), norm_scale=circuit.ONE / 16)
    out = tmp_path_factory.mktemp("circuit-model")
    model.to(torch.bfloat16).save_pretrained(str(out))
    save_hf_tokenizer(tokenizer, out, spec.max_position_embeddings)
    return out


def _greedy_chain_accuracy(model_dir: Path, shared_tokens: int, trajectories: int) -> tuple[int, int]:
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tasks.recall import recall_output_len
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    spec = TraceSpec(shared_tokens=shared_tokens, num_trajectories=trajectories, seed=3, task="recall", roles="recall",
                     output_len=recall_output_len(tokenizer.encode))
    return chain_accuracy(model_dir, tokenizer, generate_trace(spec, tokenizer)[1])


def test_the_untrained_circuit_answers_every_hop_by_reading_the_table(circuit_model_dir: Path) -> None:
    right, total = _greedy_chain_accuracy(circuit_model_dir, shared_tokens=2048, trajectories=2)
    assert total == 8
    assert right == total


def test_the_answer_is_the_name_and_a_newline(circuit_model_dir: Path) -> None:
    from kvbench.tracegen.tasks.recall import recall_output_len
    from kvbench.tracegen.tokenizer import load_tokenizer

    assert recall_output_len(load_tokenizer(str(circuit_model_dir)).encode) == 3


def test_word_codes_are_distinct_and_two_bits_apart() -> None:
    codes = circuit.word_codes(NAME_WORDS)
    stacked = torch.stack(list(codes.values()))
    assert len({tuple(c.tolist()) for c in stacked}) == len(NAME_WORDS)
    distances = (stacked[:, None, :] != stacked[None, :, :]).sum(-1)
    distances.fill_diagonal_(circuit.CODE_BITS)
    assert int(distances.min()) == 2


def test_training_never_moves_the_circuit(circuit_model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(str(circuit_model_dir))
    fresh = LlamaForCausalLM(config)
    frozen = circuit.install(fresh, recall_circuit_spec(Tokenizer.from_file(str(circuit_model_dir / "tokenizer.json"))),
                             norm_scale=circuit.ONE / 16)
    before = {name: p.detach().clone() for name, p in fresh.named_parameters()}
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.5)
    batch = torch.randint(0, config.vocab_size, (2, 64))
    loss = fresh(input_ids=batch, labels=batch).loss
    loss.backward()
    frozen.zero_grads(fresh)
    optimizer.step()
    frozen.restore(fresh)
    moved = 0
    for name, param in fresh.named_parameters():
        mask = frozen.masks.get(name)
        if mask is not None:
            assert torch.equal(param[mask], before[name][mask]), name
            moved += int((param[~mask] != before[name][~mask]).any())
        else:
            moved += int((param != before[name]).any())
    assert moved > 10  # the trained part did train


def test_the_circuit_refuses_shapes_it_cannot_hold() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    spec = circuit.CircuitSpec(question_tokens=7, name_token_ids={"amber": (1, 2)}, newline_id=3, arrow_id=4,
                               colon_id=5)
    with pytest.raises(ValueError, match="recall circuit"):
        circuit.install(LlamaForCausalLM(config), spec, norm_scale=2.0)
