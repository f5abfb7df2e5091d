"""The connector's partial forward (methods/connector/forward.py) against a Llama forward written
out here in plain torch, over a small model of random weights built from modules shaped like
vLLM's (a QKV projection returning (out, bias), fused add-RMSNorm, a rotary table): every row
computed by it equals the dense forward's K/V, and so do the rows it computes around rows placed
from the dense cache. On the CPU the attention goes through the SDPA path (the CPU kernel needs
vLLM); on a CUDA device (a lent GPU: `python -m pytest --noconftest tests/unit/methods/test_partial_forward.py`)
the whole path runs there, row indices and tokens handed over on the host as the loads do."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.core.forward import PartialForward
from kvbench.methods.core.paged import KVHalvesLayout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, BLOCK = 3, 64, 4, 2, 16, 96, 101, 8
THETA = 10000.0


class Linear(torch.nn.Module):
    """vLLM's linear layers return (output, bias)."""

    def __init__(self, rows: int, cols: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, cols, generator=generator) / cols ** 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.T, None


class RMSNorm(torch.nn.Module):
    """vLLM's RMSNorm: norm(x), or with a residual (x + residual) normed and the sum returned."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=generator))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out if residual is None else (out, residual)


class Rotary(torch.nn.Module):
    is_neox_style = True
    rotary_dim = HEAD_DIM

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache())

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = torch.outer(torch.arange(4096).float(), inv)
        return torch.cat((angles.cos(), angles.sin()), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, index: int, generator: torch.Generator) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.q_size, self.kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.qkv_proj = Linear(self.q_size + 2 * self.kv_size, HIDDEN, generator)
        self.o_proj = Linear(HIDDEN, self.q_size, generator)
        self.rotary_emb = Rotary()
        self.attn = torch.nn.Module()
        self.attn.layer_name = f"layers.{index}.attn"
        self.attn.impl = type("Impl", (), {"scale": HEAD_DIM ** -0.5})()


class MLP(torch.nn.Module):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.gate_up_proj = Linear(2 * FFN, HIDDEN, generator)
        self.down_proj = Linear(HIDDEN, FFN, generator)
        self.act_fn = torch.nn.SiLU()  # not vLLM's SiluAndMul: the forward calls the module itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)[0]


class Layer(torch.nn.Module):
    def __init__(self, index: int, generator: torch.Generator) -> None:
        super().__init__()
        self.self_attn = Attention(index, generator)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(generator), RMSNorm(generator)
        self.mlp = MLP(generator)


class Inner(torch.nn.Module):
    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:  # what vLLM's Llama model offers
        return self.embed_tokens(ids)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.model = Inner()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
        self.model.layers = torch.nn.ModuleList(Layer(i, generator) for i in range(LAYERS))
        self.model.start_layer, self.model.end_layer = 0, LAYERS


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, device=x.device).float() / HEAD_DIM))
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def dense_cache(model: Model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [layers, n, Hkv, hd] of a plain causal Llama forward over `tokens`."""
    n = len(tokens)
    positions = torch.arange(n, device=tokens.device)
    x = model.model.embed_tokens(tokens)
    keys, values = [], []
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h)[0].split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = _rope(q.reshape(n, HEADS, HEAD_DIM), positions)
        k = _rope(k.reshape(n, KV_HEADS, HEAD_DIM), positions)
        v = v.reshape(n, KV_HEADS, HEAD_DIM)
        keys.append(k)
        values.append(v)
        groups = HEADS // KV_HEADS
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
            v.repeat_interleave(groups, 1).transpose(0, 1), is_causal=True)
        x = x + attn.o_proj(out.transpose(0, 1).reshape(n, -1))[0]
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return torch.stack(keys), torch.stack(values)


def _setup(device: str, monkeypatch: pytest.MonkeyPatch, n: int):  # type: ignore[no-untyped-def]
    if device == "cpu":  # the CPU kernel is vLLM's: the device-independent SDPA path instead
        monkeypatch.setattr(PartialForward, "_attend", PartialForward._sdpa_attention)
    model = Model().to(device)
    names = [layer.self_attn.attn.layer_name for layer in model.model.layers]
    blocks = -(-n // BLOCK) + 3
    caches = {name: torch.zeros(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, device=device) for name in names}
    layouts = dict.fromkeys(names, KVHalvesLayout(HEAD_DIM))
    forward = PartialForward(model, names, layouts, caches)
    # as a load hands them over: on the host, the request's blocks out of order
    block_ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[: -(-n // BLOCK)]
    positions = torch.arange(n)
    slots = block_ids[positions // BLOCK] * BLOCK + positions % BLOCK
    tokens = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(2))
    return model, forward, layouts, caches, names, block_ids, slots, tokens


def _read(layouts, caches, names, block_ids, n):  # type: ignore[no-untyped-def]
    rows = [layouts[name].read(caches[name], block_ids, n) for name in names]
    return torch.stack([k for k, _ in rows]), torch.stack([v for _, v in rows])


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_computed_equals_the_dense_forward(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 45
    model, forward, layouts, caches, names, block_ids, slots, tokens = _setup(device, monkeypatch, n)
    nothing = (torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0))
    with torch.inference_mode():
        stats = forward.run(tokens, block_ids, slots, torch.arange(n), lambda layer: nothing)
        k, v = _read(layouts, caches, names, block_ids, n)
        dense_k, dense_v = dense_cache(model, tokens.to(device))
    assert stats.computed_rows == n and stats.computed_layer_rows == n * LAYERS
    torch.testing.assert_close(k, dense_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, dense_v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_computed_around_placed_rows_equal_the_dense_forward(device: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 5..30 placed from the dense cache (exact: what a perfect reuse places), the glue before
    them and the rows after computed: every row ends as the dense forward's."""
    n = 45
    model, forward, layouts, caches, names, block_ids, slots, tokens = _setup(device, monkeypatch, n)
    with torch.inference_mode():
        dense_k, dense_v = dense_cache(model, tokens.to(device))
        placed = torch.arange(5, 30)
        compute = torch.cat((torch.arange(0, 5), torch.arange(30, n)))
        forward.run(tokens, block_ids, slots, compute,
                    lambda layer: (placed, dense_k[layer, 5:30], dense_v[layer, 5:30]))
        k, v = _read(layouts, caches, names, block_ids, n)
    torch.testing.assert_close(k, dense_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, dense_v, rtol=1e-4, atol=1e-4)
    # ...and a wrong placement shows in the rows computed after it (the test can fail)
    with torch.inference_mode():
        forward.run(tokens, block_ids, slots, compute,
                    lambda layer: (placed, 2 * dense_k[layer, 5:30], dense_v[layer, 5:30]))
        k, _ = _read(layouts, caches, names, block_ids, n)
    assert not torch.allclose(k[1:, 30:], dense_k[1:, 30:], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_the_worker_aligner_re_rotates_keys_where_the_model_is(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the worker builds it at attach (RopeAligner of the model's rotary module, moved to the
    model's device): keys moved by one shift per row (a scattered reuse: the elementwise path)
    and by one shift for all (the GEMM path) land where a dense forward puts them."""
    from kvbench.methods.core.rope import RopeAligner

    n = 45
    model, forward, *_ = _setup(device, monkeypatch, n)
    aligner = RopeAligner(forward.rotary_emb).to(forward.device)
    with torch.inference_mode():
        keys = torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(device)
        at_zero = torch.stack([_rope(k, torch.zeros(n, dtype=torch.long, device=device)) for k in keys])
        per_row = torch.arange(n) * 3 + 7  # host-side shifts, as the plans hold them
        moved = aligner.rotate(at_zero, per_row)
        expected = torch.stack([_rope(k, per_row.to(device)) for k in keys])
        torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aligner.rotate(at_zero, 11), torch.stack([_rope(k, torch.full((n,), 11, device=device))
                                                                             for k in keys]), rtol=1e-4, atol=1e-4)
