"""Layer-by-layer partial forward over the loaded vLLM model's own modules.

Computes K/V for chosen token rows of a request (PF glue, fallbacks, tokens chosen for
recomputation) while the other rows' K/V come from elsewhere: every row is written into the
request's paged blocks before attention, and attention runs over those blocks with the
backend's own kernel (CPU) or torch SDPA (other devices). Follows the Llama decoder-layer
structure (input_layernorm, self_attn.{qkv_proj, rotary_emb, o_proj}, post_attention_layernorm,
mlp), shared by Llama, Mistral, Qwen2 and most vLLM decoder models.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvbench.methods.core.layer_fit import check_llama_layers
from kvbench.methods.core.lora import VLora
from kvbench.methods.core.paged import CpuPackedLayout, cpu_cache_halves

# layer index -> (row indices, K, V) of the rows not computed here, to place before attention
RowsForLayer = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# (layer index, computed rows, their Q, K, V) -> positions in the computed rows to keep computing
# in the layers after this one, or None to keep them all (selective recomputation)
NarrowRows = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]
# (layer index, the value projection's input [n, hidden]) of a context-free pass's rows (PReCache)
ValueInputs = Callable[[int, torch.Tensor], None]


def _base(module: torch.nn.Module) -> torch.nn.Module:
    """A linear layer without vLLM's LoRA wrapper: the wrapper applies the adapters of the batch
    vLLM last ran (its token-to-adapter map), which the connector's own rows do not belong to."""
    return getattr(module, "base_layer", module)


Result = TypeVar("Result")


def run_to_end(steps: Generator[int, None, Result]) -> Result:
    """Drive a step generator (`PartialForward.steps`, the connector's loads) to its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@dataclass
class LayerGroup:
    """Rows computed only in layers [start, stop) (layer-selective recomputation, DroidSpeak): they
    join the computed rows at `start` with the residual stream `entering` [rows, hidden size] (at
    start 0, their token embeddings: `entering` is not needed) and leave after layer stop - 1's K/V."""

    rows: torch.Tensor
    entering: torch.Tensor | None
    start: int
    stop: int


@dataclass
class ForwardStats:
    computed_rows: int = 0  # rows computed at layer 0
    computed_layer_rows: int = 0  # sum over layers
    attention_s: float = 0.0
    # (rows, residual stream entering `capture_layer`) of the rows computed in that layer
    captured: tuple[torch.Tensor, torch.Tensor] | None = None


class PartialForward:
    def __init__(self, model: torch.nn.Module, layer_names: list[str], layouts: dict, kv_caches: dict) -> None:
        inner = model.model
        # the token embedding without vLLM's LoRA wrapper too (its index buffer is the last
        # batch's, and no longer than the scheduler's token budget)
        embed_tokens = getattr(inner, "embed_tokens", None)
        self.embed = getattr(embed_tokens, "base_layer", None) or inner.embed_input_ids
        self.layers = list(inner.layers)[inner.start_layer:inner.end_layer]
        check_llama_layers(self.layers, type(model).__name__)  # refused at start, not computed wrongly
        self.layer_names = layer_names
        self.layouts = layouts
        self.kv_caches = kv_caches
        if len(self.layers) != len(layer_names):
            raise RuntimeError(f"{len(self.layers)} decoder layers but {len(layer_names)} KV caches")

    @property
    def rotary_emb(self) -> torch.nn.Module:
        return self.layers[0].self_attn.rotary_emb

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: the plan's token ids and positions, built on the host,
        go there (row indices stay on the host for the bookkeeping)."""
        return next(self.layers[0].parameters()).device

    def run(self, tokens: torch.Tensor, block_ids: torch.Tensor, slots: torch.Tensor, compute: torch.Tensor,
            placed_rows: RowsForLayer, narrow: NarrowRows | None = None, group: LayerGroup | None = None,
            capture_layer: int | None = None, lora: VLora | None = None) -> ForwardStats:
        """All layers at once (see `steps`)."""
        return run_to_end(self.steps(tokens, block_ids, slots, compute, placed_rows, narrow, group, capture_layer,
                                     lora))

    @torch.inference_mode()  # entered again at every resumption of the generator
    def steps(self, tokens: torch.Tensor, block_ids: torch.Tensor, slots: torch.Tensor, compute: torch.Tensor,
              placed_rows: RowsForLayer, narrow: NarrowRows | None = None, group: LayerGroup | None = None,
              capture_layer: int | None = None, lora: VLora | None = None) -> Generator[int, None, ForwardStats]:
        """The partial forward one layer at a time: yields the rows computed in each layer, so
        that a caller may spread the layers over engine steps; returns the stats.
        `tokens`/`slots`: all n rows of the request; `compute`: indices of rows to compute.
        `narrow` may shrink the computed rows after a layer's K/V is written: the dropped rows
        keep their placed K/V in the layers after it. `group` adds rows computed in a range of
        layers only (`narrow` may drop some of them before the range ends). `capture_layer`: keep
        the residual stream entering that layer for the rows computed there (ForwardStats.captured).
        `lora`: the request's V-only adapter, added to the computed rows' values."""
        import time

        if group is not None and not len(group.rows):
            group = None
        stats = ForwardStats(computed_rows=len(compute))
        device = self.device
        tokens = tokens.to(device)
        positions = torch.arange(len(tokens), dtype=torch.long, device=device)
        hidden = self.embed(tokens[compute.to(device)]) if len(compute) else None
        residual = None
        if group is not None and group.start == 0:  # the group enters with its token embeddings
            compute, hidden, residual = self._join(compute, hidden, None, group.rows,
                                                   self.embed(tokens[group.rows.to(device)]), before_first_layer=True)
        layer_rows = 0
        for index, (layer, name) in enumerate(zip(self.layers, self.layer_names)):
            if index:
                yield layer_rows  # the previous layer is done: a caller may pause here
                layer_rows = 0
            rows, k_rows, v_rows = placed_rows(index)
            layout, cache = self.layouts[name], self.kv_caches[name]
            layout.write(cache, slots[rows], k_rows, v_rows)
            if group is not None and index == group.start and index > 0:
                assert group.entering is not None
                compute, hidden, residual = self._join(compute, hidden, residual, group.rows, group.entering,
                                                       before_first_layer=False)
            if len(compute) == 0:
                continue  # vLLM's CPU kernels crash (SIGFPE) on 0-row GEMMs and norms
            attn = layer.self_attn
            q, k, v, residual = self._qkv(layer, hidden, residual, positions[compute.to(device)], index, lora)
            if index == capture_layer:  # copies: vLLM's fused add-norm updates the residual in place
                stats.captured = (compute.clone(), residual.clone())
            layout.write(cache, slots[compute], k, v)
            stats.computed_layer_rows += len(compute)
            layer_rows = len(compute)
            if index == len(self.layers) - 1:
                break  # the last layer's K/V is all the cache needs
            # Dropped rows keep the K/V placed for them in later layers; their queries and hidden
            # states are not needed further.
            keep = narrow(index, compute, q, k, v) if narrow is not None else None
            if keep is not None:
                compute, q, residual = compute[keep], q[keep], residual[keep]
            if group is not None and index == group.stop - 1:  # the group's last layer: its rows leave
                keep = (~torch.isin(compute, group.rows)).nonzero().flatten()
                compute, q, residual = compute[keep], q[keep], residual[keep]
            if len(compute) == 0:
                continue  # later layers still place the other rows
            started = time.perf_counter()
            out = self._attend(q, compute, attn, name, block_ids)
            stats.attention_s += time.perf_counter() - started
            o, _ = _base(attn.o_proj)(out.reshape(len(compute), -1))
            hidden, residual = layer.post_attention_layernorm(o, residual)
            hidden = self._mlp(layer.mlp, hidden)
        return stats

    @staticmethod
    def _join(compute: torch.Tensor, hidden: torch.Tensor | None, residual: torch.Tensor | None, rows: torch.Tensor,
              entering: torch.Tensor, before_first_layer: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Add rows entering a layer with the residual stream `entering` to the computed rows, in
        position order (contiguous runs keep the attention kernel's sub-requests few). Before layer
        0 there is no residual yet; later, the stream is `hidden + residual` (vLLM's fused add-norm),
        so the new rows carry it as hidden with a zero residual."""
        joined = torch.cat((compute, rows))
        order = torch.argsort(joined)
        hidden = entering if hidden is None else torch.cat((hidden, entering.to(hidden.dtype)))
        if before_first_layer:
            return joined[order], hidden[order], None
        zeros = torch.zeros_like(hidden[len(compute):])
        residual = zeros if residual is None else torch.cat((residual, zeros.to(residual.dtype)))
        return joined[order], hidden[order], residual[order]

    def _qkv(self, layer: torch.nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None,
             positions: torch.Tensor, index: int, lora: VLora | None = None,
             value_inputs: ValueInputs | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (with the residual add), QKV projection (with `lora`'s value term) and RoPE
        of decoder layer `index`: q [n, Hq, hd], k and v [n, Hkv, hd], and the updated residual.
        `value_inputs` receives the value projection's input."""
        attn = layer.self_attn
        if residual is None:
            residual = hidden
            x = layer.input_layernorm(hidden)
        else:
            x, residual = layer.input_layernorm(hidden, residual)
        if value_inputs is not None:
            value_inputs(index, x)
        qkv, _ = _base(attn.qkv_proj)(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if lora is not None:
            v = v + lora.value_term(index, lora.low_rank(index, x))
        n = len(positions)
        q = self._rotate(attn.rotary_emb, positions, q.reshape(n, attn.num_heads, attn.head_dim))
        k = self._rotate(attn.rotary_emb, positions, k.reshape(n, attn.num_kv_heads, attn.head_dim))
        return q, k, v.reshape(n, attn.num_kv_heads, attn.head_dim), residual

    # vLLM's compiled forward fuses pointwise ops and computes them in fp32 with one rounding at
    # the end; calling the modules eagerly in bf16 rounds after every op, which shows up as
    # ~0.03 of log-prob noise on a trained model. Rotary and SiLU-and-mul are redone in fp32 here.
    @staticmethod
    def _rotate(rotary: torch.nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # the rows' positions first, then the casts: the table holds every position (64K on
        # recall-v1), and casting all of it twice per call was most of a short load's time
        cos_sin = rotary.cos_sin_cache.index_select(0, positions).to(x.dtype).float()
        cos, sin = (t.unsqueeze(1) for t in cos_sin.chunk(2, dim=-1))
        rot_dim = int(rotary.rotary_dim)
        xf = x.float()
        rot = xf[..., :rot_dim]
        if rotary.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rot_dim < xf.shape[-1]:
            out = torch.cat((out, xf[..., rot_dim:]), dim=-1)
        return out.to(x.dtype)

    @staticmethod
    def _mlp(mlp: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        # vLLM's SiluAndMul, if vLLM's activations are loaded at all (a model of other modules, in
        # a process without vLLM, has none: its MLP is called as it is)
        activation = sys.modules.get("vllm.model_executor.layers.activation")
        fused = activation is not None and isinstance(getattr(mlp, "act_fn", None), activation.SiluAndMul)
        if not (fused and hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj")):
            return mlp(hidden)
        gate_up, _ = _base(mlp.gate_up_proj)(hidden)
        d = gate_up.shape[-1] // 2
        act = (torch.nn.functional.silu(gate_up[..., :d].float()) * gate_up[..., d:].float()).to(gate_up.dtype)
        out, _ = _base(mlp.down_proj)(act)
        return out

    @torch.inference_mode()  # entered again at every resumption of the generator
    def context_free_steps(self, tokens: torch.Tensor, tail_queries: list[torch.Tensor] | None = None,
                           tail: int = 0, lora: VLora | None = None, value_inputs: ValueInputs | None = None
                           ) -> Generator[int, None, tuple[torch.Tensor, torch.Tensor]]:
        """K, V [layers, n, Hkv, hd] of `tokens` prefilled alone at positions 0..n-1 (dense causal
        attention over their own K/V, in no request's blocks): a context-free reference cache. One
        layer at a time: yields the rows each layer computed (a caller may pause there, as with `steps`).
        `tail_queries`, when given, receives each layer's rotated queries of the last `tail` rows.
        `lora`: a V-only adapter applied throughout; `value_inputs` receives each layer's value
        projection input."""
        n = len(tokens)
        tokens = tokens.to(self.device)
        positions = torch.arange(n, dtype=torch.long, device=tokens.device)
        hidden, residual = self.embed(tokens), None
        keys, values = [], []
        for index, (layer, name) in enumerate(zip(self.layers, self.layer_names)):
            attn = layer.self_attn
            q, k, v, residual = self._qkv(layer, hidden, residual, positions, index, lora, value_inputs)
            if tail_queries is not None:
                tail_queries.append(q[n - tail:].clone())
            keys.append(k)
            values.append(v)
            if index == len(self.layers) - 1:
                break
            out = self._self_attention(q, k, v, attn.attn.impl.scale, name)
            o, _ = _base(attn.o_proj)(out.reshape(n, -1))
            hidden, residual = layer.post_attention_layernorm(o, residual)
            hidden = self._mlp(layer.mlp, hidden)
            yield n
        return torch.stack(keys), torch.stack(values)

    def _attend(self, q: torch.Tensor, compute: torch.Tensor, attn: torch.nn.Module, name: str,
                block_ids: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cpu":
            return _cpu_paged_attention(q, compute, attn.attn.impl.scale, self.kv_caches[name], self.layouts[name].isa,
                                        block_ids)
        return self._sdpa_attention(q, compute, attn, name, block_ids)

    def _self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        name: str) -> torch.Tensor:
        """Causal attention of rows over their own K/V alone [n, Hq, hd] (no paged blocks of a request)."""
        if q.device.type == "cpu":
            return cpu_self_attention(q, k, v, scale, self.layouts[name])
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)

    def _sdpa_attention(self, q: torch.Tensor, compute: torch.Tensor, attn: torch.nn.Module, name: str,
                        block_ids: torch.Tensor) -> torch.Tensor:
        """Causal-by-position attention over the paged rows (devices without a CPU kernel)."""
        n = int(compute.max()) + 1
        k_all, v_all = self.layouts[name].read(self.kv_caches[name], block_ids, n)
        mask = torch.arange(n, device=q.device)[None, :] <= compute.to(q.device)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_all.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v_all.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, scale=attn.attn.impl.scale,
            enable_gqa=q.shape[1] != k_all.shape[1])
        return out[0].transpose(0, 1)


def cpu_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       layout: CpuPackedLayout) -> torch.Tensor:
    """Causal attention of n rows over their own K/V [n, Hkv, hd], through vLLM's CPU kernel over
    a scratch paged cache in `layout` (its dtype) of ceil(n / block size) blocks: torch's CPU
    SDPA took 1.2x as long at 8K rows (a context-free reference prefill). Returns [n, Hq, hd]."""
    n, heads, head_dim = k.shape
    blocks = -(-n // layout.block_size)
    # zeros: the unused tail of the last block is never NaN
    scratch = torch.zeros(blocks, heads, layout.block_size, 2 * head_dim, dtype=layout.dtype)
    rows = torch.arange(n)
    layout.write(scratch, rows, k.to(layout.dtype), v.to(layout.dtype))
    return _cpu_paged_attention(q, rows, scale, scratch, layout.isa, torch.arange(blocks))


def _cpu_paged_attention(q: torch.Tensor, compute: torch.Tensor, scale: float, kv_cache: torch.Tensor,
                         isa: str, block_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU attention kernel over the request's blocks. Each contiguous run [s, e) of computed
    rows is posed as one chunked-prefill sub-request (query rows s..e-1, seq_len e, same block
    table), which makes the mask causal by position without a dense mask."""
    import vllm.envs as envs
    from vllm import _custom_ops as ops

    breaks = torch.nonzero(compute[1:] - compute[:-1] != 1).flatten() + 1
    starts = torch.cat((torch.tensor([0]), breaks))
    ends = torch.cat((breaks, torch.tensor([len(compute)])))
    seq_lens = (compute[ends - 1] + 1).to(torch.int32)
    query_start = torch.zeros(len(starts) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(ends - starts, 0)
    block_table = block_ids.to(torch.int32).unsqueeze(0).expand(len(starts), -1).contiguous()
    k_half, v_half = cpu_cache_halves(kv_cache)
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(starts), num_heads=q.shape[1], num_kv_heads=kv_cache.shape[1], head_dim=q.shape[2],
        seq_lens=seq_lens, dtype=q.dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q.contiguous(), key_cache=k_half, value_cache=v_half, output=out, query_start_loc=query_start,
        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=block_table, softcap=0, scheduler_metadata=scheduler_metadata, s_aux=None)
    return out
