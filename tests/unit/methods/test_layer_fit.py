"""The connector refuses, at server start, models whose decoder layers are not the Llama layer its
partial forward computes (Gemma 3's sliding windows and extra norms, Qwen3's q/k norms), naming
what it does not support; Llama-structured layers pass."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.core.layer_fit import UnsupportedLayersError, check_llama_layers, unsupported_features


class _Attention(torch.nn.Module):
    def __init__(self, window: int | None = None, qk_norm: bool = False) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj, self.rotary_emb = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()
        self.attn = torch.nn.Identity()
        self.attn.sliding_window = window  # as vLLM's Attention layer carries it
        if qk_norm:
            self.q_norm, self.k_norm = torch.nn.Identity(), torch.nn.Identity()


class _Layer(torch.nn.Module):
    def __init__(self, attention: _Attention, gemma_norms: bool = False) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = torch.nn.Identity(), torch.nn.Identity()
        self.self_attn, self.mlp = attention, torch.nn.Identity()
        if gemma_norms:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = torch.nn.Identity()


def test_llama_layers_fit() -> None:
    layers = [_Layer(_Attention()) for _ in range(4)]
    assert unsupported_features(layers[0]) == []
    check_llama_layers(layers, "LlamaForCausalLM")


def test_gemma3_layers_are_refused_naming_each_feature_and_its_layers() -> None:
    # Gemma 3: five sliding-window layers for every global one, q/k norms, norms around each block
    layers = [_Layer(_Attention(window=None if (i + 1) % 6 == 0 else 512, qk_norm=True), gemma_norms=True)
              for i in range(12)]
    with pytest.raises(UnsupportedLayersError) as caught:
        check_llama_layers(layers, "Gemma3ForCausalLM")
    message = str(caught.value)
    assert "Gemma3ForCausalLM" in message and "NonShared (plain vLLM) serves it" in message
    assert "sliding-window attention (512 tokens; the connector's attention is global) (layers 0-4, 6-10)" in message
    assert "q/k RMSNorm inside attention (layers 0-11)" in message
    assert "norms before and after each block (layers 0-11)" in message


def test_a_layer_missing_what_the_forward_calls_is_refused() -> None:
    layer = _Layer(_Attention())
    del layer.post_attention_layernorm
    del layer.self_attn.qkv_proj
    assert unsupported_features(layer) == ["no post_attention_layernorm", "no self_attn.qkv_proj"]
