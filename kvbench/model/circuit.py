"""The recall model's constructed retrieval circuit (the documented hybrid of issue 23).

On two CPU cores, a Llama trained from scratch does not learn to look a name up in a long table
within hours (benchmarks/recall_probe.py: 9.6% of hops after 20 minutes). So the first three
layers of the recall model hold, in a reserved part of the residual stream, the circuit real
models grow for the job (previous-token heads feeding an induction-style lookup), set by hand and
kept fixed; every other weight is trained (kvbench.model.recall_build). The two parts meet only
in RMSNorm: the trained part neither reads nor writes the circuit's dims. The circuit:

- Embeddings: every token carries a constant (`one`); the words names are made of carry an 8-bit
  even-parity code (`code`, the same for "amber" at a line's start and " amber") and a flag; the
  arrow, ":" and "\n" carry flags of their own.
- Layer 0, four positional heads (RoPE's 16 fastest pairs, peaking at one offset): each position
  gets the code of the tokens 1, 3 and 4 back (`p1`, `p3`, `p4`) and the classes of those 1-3
  back. Its MLP marks a name's first word (`va`), its second (`vb`), and "the answer's name is
  complete" (`nl`: a name's second word right after the question's ":\n"), which writes "\n".
- Layer 1, four positional heads: at the prompt's last position and the next one, the name that
  ends 3 tokens before the question (the start name for the first agent, the last note for the
  others) is gathered into `qa1/qb1` and `qa2/qb2`.
- Layer 2, one lookup head per answer token: the gathered name is matched, in RoPE's 8 slowest
  pairs (which turn by < 0.2 rad over 32K tokens with rope_theta 1e7 and head_dim 64: content
  matching at any distance), against every position's `p4/p3`, plus "the token 2 back is the
  arrow": the match lands on the second word of the line `A B -> C D`, and the head copies the
  target's first word (`p1` there) or its second (`code`). Its MLP lets them through to the
  output fields, which the untied LM head reads for the name tokens, only where an answer is
  written (after the question's ":\n"), so the lookup firing mid-table costs nothing in training.

The circuit reads only tokens near each position, so it does not depend on what precedes the
table: a cache reused from another agent's prompt keeps it intact (what reuse loses lives in the
trained part).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

CODE_BITS = 8
# Residual-stream magnitudes: the constant dominates the RMS so that RMSNorm scales the circuit
# by about the same factor at every position, whatever the trained part writes.
ONE = 32.0
UNIT = 2.0
# Attention logit margins (nats) of the positional heads over their neighbours and of a full
# name match over a half match; MLP gate sharpness.
POSITION_MARGIN = 25.0
MATCH_MARGIN = 25.0
GATE = 8.0
ARROW_LOGIT = 30.0
NAME_LOGIT = 40.0
NEWLINE_LOGIT = 30.0
FAST_PAIRS = 16  # RoPE pairs the positional heads use
SLOW_PAIRS = CODE_BITS  # the slowest pairs carry content matching


@dataclasses.dataclass(frozen=True)
class CircuitSpec:
    """What the circuit needs to know about the prompt format, measured with the tokenizer."""

    question_tokens: int  # tokens of the question that ends every prompt ("\n\nNext name:\n")
    name_token_ids: dict[str, tuple[int, int]]  # word -> (line-start form, space form) token ids
    newline_id: int
    arrow_id: int  # " ->"
    colon_id: int  # ":" (the question ends ":\n")


class Layout:
    """Named slices of the residual stream, allocated from the top."""

    FIELDS = (("one", 1), ("code", CODE_BITS), ("is_name", 1), ("is_arrow", 1), ("is_colon", 1), ("is_newline", 1),
              ("p1", CODE_BITS + 1), ("p1_colon", 1), ("p1_newline", 1), ("p2_arrow", 1), ("p2_colon", 1),
              ("p2_newline", 1), ("p3", CODE_BITS + 1), ("p3_colon", 1), ("p4", CODE_BITS),
              ("va", CODE_BITS), ("vb", CODE_BITS), ("nl", 1), ("qa1", CODE_BITS), ("qb1", CODE_BITS),
              ("qa2", CODE_BITS), ("qb2", CODE_BITS), ("lk_line", CODE_BITS), ("lk_space", CODE_BITS),
              ("out_line", CODE_BITS), ("out_space", CODE_BITS))

    def __init__(self, hidden_size: int) -> None:
        self.width = sum(n for _, n in self.FIELDS)
        if self.width > hidden_size // 2:
            raise ValueError(f"hidden size {hidden_size} too small for the recall circuit ({self.width} dims)")
        self.start = hidden_size - self.width
        self.slices: dict[str, slice] = {}
        at = self.start
        for name, n in self.FIELDS:
            self.slices[name] = slice(at, at + n)
            at += n

    def __getitem__(self, name: str) -> slice:
        return self.slices[name]

    def idx(self, name: str, i: int = 0) -> int:
        return self.slices[name].start + i


def word_codes(words: Sequence[str]) -> dict[str, torch.Tensor]:
    """Distinct even-parity codes of CODE_BITS bits as +-1 vectors: two codes differ in >= 2 bits."""
    codes = [c for c in range(2 ** CODE_BITS) if bin(c).count("1") % 2 == 0]
    if len(words) > len(codes):
        raise ValueError(f"{len(words)} name words, but only {len(codes)} codes")
    out = {}
    for word, c in zip(words, codes):
        out[word] = torch.tensor([1.0 if c >> b & 1 else -1.0 for b in range(CODE_BITS)])
    return out


@dataclasses.dataclass
class FrozenParams:
    """Per parameter name: which entries the circuit owns and their values (restored after
    every optimizer step, so weight decay and stray gradients never move them)."""

    masks: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]

    @torch.no_grad()
    def restore(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, mask in self.masks.items():
            param = params[name]
            param.copy_(torch.where(mask, self.values[name].to(param.dtype), param))

    def zero_grads(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, mask in self.masks.items():
            grad = params[name].grad
            if grad is not None:
                grad.masked_fill_(mask, 0.0)


def rope_inv_freq(config: object) -> torch.Tensor:
    head_dim = config.head_dim  # type: ignore[attr-defined]
    theta = config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]  # type: ignore[attr-defined]
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def install(model: torch.nn.Module, spec: CircuitSpec, norm_scale: float) -> FrozenParams:
    """Write the circuit into a freshly initialized LlamaForCausalLM; returns what it owns.

    `norm_scale` is the RMS of the residual stream (about ONE / 16 when the constant dominates):
    the circuit's RMSNorm weights are set to it so normalized circuit values equal raw ones."""
    config = model.config
    hidden, head_dim = config.hidden_size, config.head_dim
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    if n_heads != 4 or n_kv != 2 or head_dim < 2 * (FAST_PAIRS + 1 + SLOW_PAIRS) or config.num_hidden_layers < 4:
        raise ValueError("the recall circuit needs 4 query heads, 2 KV heads, head_dim >= 50 and >= 4 layers")
    if config.tie_word_embeddings:
        raise ValueError("the recall circuit needs untied embeddings")
    lay = Layout(hidden)
    circ = slice(lay.start, hidden)
    half = head_dim // 2
    inv_freq = rope_inv_freq(config)
    codes = word_codes(sorted(spec.name_token_ids))
    params = dict(model.named_parameters())
    masks = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in params.items()}
    scale = 1.0 / math.sqrt(head_dim)

    def own(name: str, index: tuple[object, ...] | object, value: torch.Tensor | float | None = None) -> None:
        with torch.no_grad():
            if value is not None:
                params[name][index] = value  # type: ignore[index]
            masks[name][index] = True  # type: ignore[index]

    # The trained part never writes the circuit's dims.
    with torch.no_grad():
        for name in params:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                own(name, (circ, slice(None)), 0.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                "up_proj.weight")):
                own(name, (slice(None), circ), 0.0)  # nor reads them: the two parts meet only in RMSNorm
            elif name.endswith("norm.weight"):
                own(name, circ, norm_scale)
        own("model.embed_tokens.weight", (slice(None), circ), 0.0)
        own("lm_head.weight", (slice(None), circ), 0.0)
        emb = params["model.embed_tokens.weight"]
        emb[:, lay.idx("one")] = ONE
        head = params["lm_head.weight"]
        for word, (line_id, space_id) in spec.name_token_ids.items():
            for token in (line_id, space_id):
                emb[token, lay["code"]] = UNIT * codes[word]
                emb[token, lay.idx("is_name")] = UNIT
            per_bit = NAME_LOGIT / (UNIT * CODE_BITS)
            head[line_id, lay["out_line"]] = per_bit * codes[word]
            head[space_id, lay["out_space"]] = per_bit * codes[word]
        head[spec.newline_id, lay.idx("nl")] = NEWLINE_LOGIT / UNIT
        emb[spec.arrow_id, lay.idx("is_arrow")] = UNIT
        emb[spec.colon_id, lay.idx("is_colon")] = UNIT
        emb[spec.newline_id, lay.idx("is_newline")] = UNIT

    def flag_index(flag: str) -> int:
        if flag in ("p1_name", "p3_name"):
            return lay.idx(flag[:2], CODE_BITS)
        return lay.idx(flag)

    def attn(layer: int, proj: str) -> str:
        return f"model.layers.{layer}.self_attn.{proj}_proj.weight"

    def mlp(layer: int, proj: str) -> str:
        return f"model.layers.{layer}.mlp.{proj}_proj.weight"

    def positional_key(layer: int, kv_head: int) -> None:
        """Key of a positional head: the constant in the fast pairs' real parts."""
        rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        k = torch.zeros(head_dim, hidden)
        amplitude = math.sqrt(positional_pair_amplitude(inv_freq) / scale) / ONE
        k[:FAST_PAIRS, lay.idx("one")] = amplitude
        own(attn(layer, "k"), (rows, slice(None)), k)

    def positional_query(layer: int, head: int, offset: int) -> None:
        """Query peaking `offset` tokens back: the key's pattern turned back by offset * theta."""
        rows = slice(head * head_dim, (head + 1) * head_dim)
        q = torch.zeros(head_dim, hidden)
        amplitude = math.sqrt(positional_pair_amplitude(inv_freq) / scale) / ONE
        angles = offset * inv_freq[:FAST_PAIRS]
        q[:FAST_PAIRS, lay.idx("one")] = (amplitude * torch.cos(angles)).float()
        q[half:half + FAST_PAIRS, lay.idx("one")] = (-amplitude * torch.sin(angles)).float()
        own(attn(layer, "q"), (rows, slice(None)), q)

    def value(layer: int, kv_head: int, fields: Sequence[str]) -> None:
        rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        v = torch.zeros(head_dim, hidden)
        at = 0
        for field in fields:
            s = lay[field]
            n = s.stop - s.start
            v[at:at + n, s] = torch.eye(n)
            at += n
        own(attn(layer, "v"), (rows, slice(None)), v)

    def output(layer: int, head: int, pieces: Sequence[tuple[int, str]]) -> None:
        """Head output: value dims starting at `first` go to residual field `field`."""
        cols = slice(head * head_dim, (head + 1) * head_dim)
        o = torch.zeros(hidden, head_dim)
        for first, field in pieces:
            s = lay[field]
            n = s.stop - s.start
            o[s, first:first + n] = torch.eye(n)
        own(attn(layer, "o"), (slice(None), cols), o)

    def gated_copy(layer: int, first_unit: int, flags: dict[str, float], threshold: float, source: str | None,
                   dest: str) -> int:
        """MLP units writing `source` (or the constant UNIT) into `dest` where the 0/1 `flags`,
        weighted, sum above threshold / 2: gate = GATE * (2 * sum - threshold). Returns the next unit."""
        gate, up, down = (params[mlp(layer, p)] for p in ("gate", "up", "down"))
        width = lay[dest].stop - lay[dest].start
        with torch.no_grad():
            for j in range(width):
                unit = first_unit + j
                gate[unit] = 0.0
                for flag, weight in flags.items():
                    gate[unit, flag_index(flag)] = 2 * weight * GATE / UNIT
                gate[unit, lay.idx("one")] = -threshold * GATE / ONE
                up[unit] = 0.0
                if source is None:
                    up[unit, lay.idx("one")] = UNIT / ONE
                else:
                    up[unit, lay.idx(source, j)] = 1.0
                down[:, unit] = 0.0
                down[lay.idx(dest, j), unit] = 1.0 / GATE
        units = slice(first_unit, first_unit + width)
        masks[mlp(layer, "gate")][units] = True
        masks[mlp(layer, "up")][units] = True
        masks[mlp(layer, "down")][:, units] = True
        return first_unit + width

    # Layer 0: the codes 1, 3 and 4 tokens back, and the token classes 1-3 back the gates need.
    for kv in range(2):
        positional_key(0, kv)
        value(0, kv, ("code", "is_name", "is_arrow", "is_colon", "is_newline"))
    arrow_at, colon_at, newline_at = CODE_BITS + 1, CODE_BITS + 2, CODE_BITS + 3
    for head, offset, pieces in ((0, 1, ((0, "p1"), (colon_at, "p1_colon"), (newline_at, "p1_newline"))),
                                 (1, 3, ((0, "p3"), (colon_at, "p3_colon"))),
                                 (2, 4, ((0, "p4"),)),
                                 (3, 2, ((arrow_at, "p2_arrow"), (colon_at, "p2_colon"), (newline_at, "p2_newline")))):
        positional_query(0, head, offset)
        output(0, head, pieces)

    # Layer 0 MLP: a name's first word (va), its second (vb), and "the answer's name is complete"
    # (nl: a name's second word right after the question's ":\n"), which writes the newline.
    unit = gated_copy(0, 0, {"is_name": 1, "p1_name": -1}, 1, "code", "va")
    unit = gated_copy(0, unit, {"is_name": 1, "p1_name": 1}, 3, "code", "vb")
    gated_copy(0, unit, {"is_name": 1, "p1_name": 1, "p2_newline": 1, "p3_colon": 1}, 7, None, "nl")

    # Layer 1: gather the name that ends 3 tokens before the question.
    q_len = spec.question_tokens
    for kv in range(2):
        positional_key(1, kv)
        value(1, kv, ("va", "vb"))
    for head, offset, first, field in ((0, q_len + 2, 0, "qa1"), (1, q_len + 1, CODE_BITS, "qb1"),
                                       (2, q_len + 3, 0, "qa2"), (3, q_len + 2, CODE_BITS, "qb2")):
        positional_query(1, head, offset)
        output(1, head, ((first, field),))

    # Layer 2: the lookup. Content in the slowest pairs: query name (first, second word) against
    # the words 4 and 3 tokens back; logit margin MATCH_MARGIN between a full and a half match.
    # The pair just faster than those checks that the token 2 back is the arrow (so a name that
    # is some line's target, followed by the next line's name, does not match).
    slow = list(range(half - SLOW_PAIRS, half))
    arrow_pair = half - SLOW_PAIRS - 1
    match_gain = math.sqrt(MATCH_MARGIN / (scale * UNIT * UNIT * CODE_BITS / 2))
    arrow_gain = math.sqrt(ARROW_LOGIT / (scale * UNIT * ONE))
    k = torch.zeros(head_dim, hidden)
    for j, pair in enumerate(slow):
        k[pair, lay.idx("p4", j)] = match_gain
        k[pair + half, lay.idx("p3", j)] = match_gain
    k[arrow_pair, lay.idx("p2_arrow")] = arrow_gain
    own(attn(2, "k"), (slice(0, head_dim), slice(None)), k)
    v = torch.zeros(head_dim, hidden)
    v[:CODE_BITS, lay["p1"].start:lay["p1"].start + CODE_BITS] = torch.eye(CODE_BITS)
    v[CODE_BITS:2 * CODE_BITS, lay["code"]] = torch.eye(CODE_BITS)
    own(attn(2, "v"), (slice(0, head_dim), slice(None)), v)
    for head, (qa, qb), first, field in ((0, ("qa1", "qb1"), 0, "lk_line"), (1, ("qa2", "qb2"), CODE_BITS, "lk_space")):
        q = torch.zeros(head_dim, hidden)
        for j, pair in enumerate(slow):
            q[pair, lay.idx(qa, j)] = match_gain
            q[pair + half, lay.idx(qb, j)] = match_gain
        q[arrow_pair, lay.idx("one")] = arrow_gain
        own(attn(2, "q"), (slice(head * head_dim, (head + 1) * head_dim), slice(None)), q)
        output(2, head, ((first, field),))
    # Layer 2 MLP: only where the answer is written (the question's last "\n" after its ":", then
    # the name's first word right after them) does the lookup reach the output: elsewhere, in a
    # table say, the gather heads also see names and the lookup runs on them.
    unit = gated_copy(2, 0, {"is_newline": 1, "p1_colon": 1}, 3, "lk_line", "out_line")
    gated_copy(2, unit, {"is_name": 1, "p1_newline": 1, "p2_colon": 1}, 5, "lk_space", "out_space")

    values = {name: p.detach().clone() for name, p in params.items() if masks[name].any()}
    return FrozenParams({n: m for n, m in masks.items() if m.any()}, values)


def positional_pair_amplitude(inv_freq: torch.Tensor) -> float:
    """Per-pair logit amplitude giving the positional heads POSITION_MARGIN over their neighbours."""
    gap = float((1 - torch.cos(inv_freq[:FAST_PAIRS])).sum())
    return POSITION_MARGIN / gap
