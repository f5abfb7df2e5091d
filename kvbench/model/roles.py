"""The role-family models: constructed test models whose shared caches depend on the reading agent.

Every model here answers `gen-trace --task role-recall` (tracegen/tasks/role_recall.py) exactly under
dense prefill, and reads the agent's route (`main` or `fallback`, named once in its system prompt)
*while it prefills the shared table*: a head at every table token attends to the role's route
word, and the route is written into the table tokens' residual stream, where later layers' K/V
read it. So a cache prefilled after one agent's prompt, reused by an agent with the other route,
answers the first agent's question. The four families place that dependence so that one family of
methods' assumption holds by construction and the others can be measured honestly against it:

- `roles-transferable`: the route only switches which of a record's two lines the lookup lands on:
  a +-UNIT flag on the route words' tokens (4 of 12 per record), written at layer 0, read by the
  lookup's keys at layer 2. The K/V delta between two routes' caches is a fixed vector per token class and layer,
  whatever the names: corrections learned on other contents carry over (KVComm, KVCMAS,
  GraphFlow), and it is spread over 1/3 of the tokens, so a 15% selection cannot fix it.
- `roles-sparse`: the route's target names are copied into one token per record (its last) at
  layer 1, read by the lookup's values at layer 3: 1 token in 12 differs, identifiable by its
  deviation (CacheBlend, RelayCaching); the copied names depend on the content.
- `roles-deep`: as content-bound, but the route is read and written only in the last two layers
  (6 and 7 of 8): earlier layers' K/V do not depend on the reader at all (DroidSpeak's assumption).
- `roles-content-bound`: the route's target names are copied into the route words' own tokens
  (4 of 12 per record) at layer 0, read by the lookup's values at layer 2: the delta is each
  token's own name code, which no correction learned on other contents predicts.

Whatever a layer writes shows in every later layer's K/V (a carrier slice of the values), as in
a real model: a family's delta starts at the layer after its write and lasts to the last layer.

The models are wholly constructed (no trained weights; recall-v1's tokenizer): they are test
models, named as such in every report that uses them, and free text is not what they are for.
They are built deterministically at first use (about a second) and checked against the weights'
recorded sha256, so every machine runs the same bytes (`kvbench model build --recipe roles`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvbench.model.circuit import CODE_BITS, word_codes
from kvbench.model.constructed import ONE, UNIT, CircuitWriter, Dim, Fields
from kvbench.model.vocabulary import NAME_WORDS, RECALL_ANSWER_PREFIX, ROUTE_ARROWS, ROUTE_WORDS

ROLES_RECIPE_VERSION = 1


@dataclass(frozen=True)
class Family:
    name: str
    # what the route changes: a class flag, copied names, or (adapter) nothing in the base model: a
    # role's V-only LoRA adapter picks its route's names at the lookup (kvbench.model.role_adapters)
    mechanism: Literal["class", "content", "adapter"]
    placement: Literal["early", "deep"]  # read at layer 0 (written by layer 1), or in the last two layers
    written_at: Literal["route-words", "record-end"]  # which table tokens carry the route
    holds_for: str  # whose assumption holds by construction
    summary: str


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("roles-transferable", "class", "early", "route-words", "delta correction (KVComm, KVCMAS, GraphFlow)",
           "the cross-role delta is one vector per token class and layer, whatever the content"),
    Family("roles-sparse", "content", "early", "record-end", "selective recomputation (CacheBlend, RelayCaching)",
           "the route lives in 1 token of 12, identifiable by its deviation"),
    Family("roles-deep", "content", "deep", "route-words", "last-layer recomputation (DroidSpeak)",
           "the route is read and written only in the last two layers"),
    Family("roles-content-bound", "content", "early", "route-words", "no method (the negative control)",
           "the delta is each token's own name: corrections from other contents cannot predict it"),
    Family("roles-adapter", "adapter", "deep", "route-words", "PReCache (V-only adapters: base values + X A B)",
           "the route is in each role's LoRA adapter, on the last layer's values only"),
)}
# Families whose route is read from the agent's system prompt (the adapter family's is in its adapters).
PROMPT_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.mechanism != "adapter")

@dataclass(frozen=True)
class RoleModelSpec:
    """Shape of every family (recall-v1's, so that timings compare with the default model)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 65536
    rope_theta: float = 1e7  # the 8 slowest of 32 pairs turn < 0.2 rad over 32K: content matches anywhere


# Logit margins (nats): a full name match over the best half match, the route flag's lines over
# each other, the route word over every other token, the answer's name over the nearest code.
MATCH_MARGIN = 25.0
FLAG_MARGIN = 25.0
ROUTE_WORD_LOGIT = 30.0
NAME_LOGIT = 40.0
NEWLINE_LOGIT = 30.0
# RoPE pairs (of 32): content matching in the 8 slowest, the flag in the next, the route word in
# the slowest (a kv head of its own, so it shares no pair with matching).
CONTENT_PAIRS = tuple(range(24, 32))
FLAG_PAIR = 23
ROUTE_PAIR = 31
# The residual's RMS: ONE dominates it (256^2 against at most ~4 * 100 from the fields, over 256
# dims), so RMSNorm scales every token alike (to 0.1%): two keys that match equally get equal
# logits whatever else their tokens carry. Every RMSNorm weight is that RMS, so that fields read at
# their written size.
NORM_SCALE = 16.05
READINGS = len(ROUTE_WORDS)
LOOKUP_VALUE_WEIGHT = 2.0  # half the attention on the line holding the name: twice its code

FIELDS = (
    ("one", 1), ("code", CODE_BITS), ("is_name", 1), ("is_arrow", READINGS), ("is_newline", 1), ("is_colon", 1),
    ("is_route_word", 1), ("route_word", READINGS),
    # gathered by layer 0's positional heads: the token 1 back, classes 2 and 3 back
    ("p1_code", CODE_BITS), ("p1_name", 1), ("p1_arrow", READINGS), ("p1_newline", 1), ("p1_colon", 1),
    ("p2_name", 1), ("p2_arrow", READINGS), ("p2_newline", 1), ("p2_colon", 1), ("p3_colon", 1),
    ("reading", READINGS),  # the route this prompt's role follows (its route word's one-hot)
    ("flag", 1), ("sel", 2 * CODE_BITS),  # the route-dependent writes
    ("balance", CODE_BITS),  # filled where `sel` is not, so a token's RMS does not depend on the reader
    # gathered by layer 1: names (first word, second word) at two table offsets and at the question
    ("pair_a", 2 * CODE_BITS), ("pair_b", 2 * CODE_BITS), ("q_a", 2 * CODE_BITS), ("q_b", 2 * CODE_BITS),
    ("key_c", 2 * CODE_BITS), ("key_d", 2 * CODE_BITS), ("query", 2 * CODE_BITS),
    ("look_1", CODE_BITS), ("look_2", CODE_BITS), ("out_line", CODE_BITS), ("out_space", CODE_BITS), ("nl", 1),
)


# Where the answer's two words are written: the prompt's last token (":" then "\n"), and the token
# after it (the first word, after that "\n" and ":").
ANSWER_FIRST = {Dim("is_newline"): 1.0, Dim("p1_colon"): 1.0}
ANSWER_SECOND = {Dim("is_name"): 1.0, Dim("p1_newline"): 1.0, Dim("p2_colon"): 1.0}


@dataclass(frozen=True)
class RoleTokens:
    """The token ids the circuit reads, measured with the tokenizer."""

    names: dict[str, tuple[int, int]]  # word -> (line-start form, space form)
    newline: int
    colon: int
    arrows: tuple[int, ...]  # " ->", " >>": ROUTE_ARROWS order
    route_words: tuple[int, ...]  # " main", " fallback": ROUTE_WORDS order
    query_offset: int  # tokens from the prompt's last token back to the asked name's second word


def role_tokens(tokenizer: Any) -> RoleTokens:
    def one(text: str) -> int:
        ids = tokenizer.encode(text).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} is not one token ({ids}): the role circuit needs it to be")
        return ids[0]

    names = {word: (one(word), one(" " + word)) for word in NAME_WORDS}
    # The asked name ends one token ("." or the note's newline) before the answer prefix.
    query_offset = len(tokenizer.encode(RECALL_ANSWER_PREFIX).ids) + 1
    return RoleTokens(names=names, newline=one("\n"), colon=one(":"),
                      arrows=tuple(one(" " + a) for a in ROUTE_ARROWS),
                      route_words=tuple(one(" " + w) for w in ROUTE_WORDS), query_offset=query_offset)


@dataclass(frozen=True)
class LayerPlan:
    reads_role: int  # the layer whose attention gathers the route word
    writes_route: int  # the layer whose MLP writes the route into table tokens
    lookup: int  # the layer whose heads look the asked name up
    layers: int

    @property
    def first_context_layer(self) -> int:
        """The first layer whose K/V depend on the reader: every later layer carries the route."""
        return self.writes_route + 1


def layer_plan(family: Family, layers: int) -> LayerPlan:
    if family.mechanism == "adapter":  # no route reader; the names per route written a layer before the lookup
        return LayerPlan(reads_role=0, writes_route=layers - 2, lookup=layers - 1, layers=layers)
    if family.placement == "deep":
        return LayerPlan(reads_role=layers - 2, writes_route=layers - 2, lookup=layers - 1, layers=layers)
    # record-end needs a name 6 tokens back, gathered at layer 1: its write waits a layer. The
    # lookup comes a layer after the route first shows in K/V, so that selective recomputation
    # (which computes every row up to the layer it checks) is judged by the rows it selects.
    if family.written_at == "record-end":
        return LayerPlan(reads_role=0, writes_route=1, lookup=3, layers=layers)
    return LayerPlan(reads_role=0, writes_route=0, lookup=2, layers=layers)


def install(model: torch.nn.Module, family: Family, tokens: RoleTokens) -> LayerPlan:
    """Write `family`'s circuit into a LlamaForCausalLM of RoleModelSpec's shape."""
    config = model.config
    fields = Fields(config.hidden_size, FIELDS)
    w = CircuitWriter(model, fields, NORM_SCALE)
    plan = layer_plan(family, config.num_hidden_layers)
    d = fields.dims

    # Embeddings and the LM head.
    codes = word_codes(sorted(tokens.names))
    for word, (line_id, space_id) in tokens.names.items():
        for token in (line_id, space_id):
            w.embed(token, "code", UNIT * codes[word])
            w.embed(token, "is_name", UNIT)
        per_bit = NAME_LOGIT / (UNIT * CODE_BITS)
        w.lm_head(line_id, "out_line", per_bit * codes[word])
        w.lm_head(space_id, "out_space", per_bit * codes[word])
    w.lm_head(tokens.newline, "nl", NEWLINE_LOGIT / UNIT)
    w.embed(tokens.newline, "is_newline", UNIT)
    w.embed(tokens.colon, "is_colon", UNIT)
    for reading, (arrow, word) in enumerate(zip(tokens.arrows, tokens.route_words)):
        w.embed(arrow, Dim("is_arrow", reading), UNIT)
        w.embed(word, "is_route_word", UNIT)
        w.embed(word, Dim("route_word", reading), UNIT)

    # Layer 0: each token's neighbours (kv head 0: codes and classes 1 and 2 back; kv head 1:
    # ":" 3 back), and, for early families, the role's route word (kv head 1, head 2).
    classes = [Dim("is_name"), *d("is_arrow"), Dim("is_newline"), Dim("is_colon")]
    w.positional_key(0, 0)
    w.value(0, 0, d("code") + classes)
    w.positional_query(0, 0, 1)
    w.output(0, 0, 0, d("p1_code") + [Dim("p1_name"), *d("p1_arrow"), Dim("p1_newline"), Dim("p1_colon")])
    w.positional_query(0, 1, 2)
    w.output(0, 1, CODE_BITS, [Dim("p2_name"), *d("p2_arrow"), Dim("p2_newline"), Dim("p2_colon")])
    w.positional_key(0, 1)
    w.value(0, 1, [Dim("is_colon")])
    w.positional_query(0, 3, 3)
    w.output(0, 3, 0, [Dim("p3_colon")])
    if family.mechanism != "adapter":
        _route_reader(w, plan.reads_role)

    # Layer 1: the names (first word, second word) a few tokens back, and the asked name.
    pair = d("p1_code") + d("code")
    table_offsets = (3, 6) if family.written_at == "record-end" else (2, 3)
    for kv in (0, 1):
        w.positional_key(1, kv)
        w.value(1, kv, pair)
    for head, (offset, field) in enumerate(zip((*table_offsets, tokens.query_offset, tokens.query_offset + 1),
                                               ("pair_a", "pair_b", "q_a", "q_b"))):
        w.positional_query(1, head, offset)
        w.output(1, head, 0, d(field))
    w.gated(1, ANSWER_FIRST, 2, d("q_a"), d("query"))
    w.gated(1, ANSWER_SECOND, 3, d("q_b"), d("query"))
    # Table tokens: a route's first word follows its arrow (class C), its second word comes next (D).
    after_arrow = {Dim("is_name"): 1.0, **{a: 1.0 for a in d("p1_arrow")}}
    two_after_arrow = {Dim("is_name"): 1.0, **{a: 1.0 for a in d("p2_arrow")}}
    if family.written_at == "record-end":
        # The record's last token (the fallback route's second word) keys the record and holds the
        # role's route, copied from 6 tokens back (main) or from its own line (fallback).
        record_end = {Dim("is_name"): 1.0, Dim("p2_arrow", READINGS - 1): 1.0}
        w.gated(1, record_end, 2, d("pair_a"), d("key_d"))
        routes = (d("pair_b"), pair)
        for reading in range(READINGS):
            w.gated(plan.writes_route, {**record_end, Dim("reading", reading): 1.0}, 3, routes[reading], d("sel"))
    else:
        w.gated(1, after_arrow, 2, d("pair_a"), d("key_c"))
        w.gated(1, two_after_arrow, 2, d("pair_b"), d("key_d"))
        for position in ("p1_arrow", "p2_arrow"):
            if family.mechanism == "adapter":  # every name of route r's line into sel's r-th half, whoever reads
                for reading in range(READINGS):
                    on_line = {Dim("is_name"): 1.0, Dim(position, reading): 1.0}
                    w.gated(plan.writes_route, on_line, 2, d("code"), route_names(w.fields, reading))
                continue
            words = {Dim("is_name"): 1.0, **{a: 1.0 for a in d(position)}}
            for reading in range(READINGS):
                on_route = {Dim("is_name"): 1.0, Dim(position, reading): 1.0, Dim("reading", reading): 1.0}
                if family.mechanism == "class":
                    w.gated(plan.writes_route, on_route, 3, 2 * UNIT, [Dim("flag")])
                else:
                    # Where the route's names are not copied, a constant of the same size: RMSNorm
                    # then scales both lines of a record alike and the lookup splits evenly.
                    off_route = {**on_route, Dim("reading", reading): 0.0, Dim("reading", READINGS - 1 - reading): 1.0}
                    w.gated(plan.writes_route, on_route, 3, d("code"), d("sel")[:CODE_BITS])
                    w.gated(plan.writes_route, off_route, 3, UNIT, d("balance"))
            if family.mechanism == "class":  # off the role's route: -UNIT (the RMS stays the same)
                w.gated(plan.writes_route, words, 2, -UNIT, [Dim("flag")])

    _lookup(w, family, plan.lookup)
    _background(w, plan)
    _carry_route(w, family, plan)
    return plan


def route_names(fields: Fields, reading: int) -> list[Dim]:
    """The adapter family's field holding the names of route `reading`'s lines (a half of `sel`)."""
    return fields.dims("sel")[reading * CODE_BITS:(reading + 1) * CODE_BITS]


def _background(w: CircuitWriter, plan: LayerPlan) -> None:
    """Layers the circuit does not use still hold K/V in a real model: here kv head 0 of each holds
    a positional key and each token's name (what layer 1 gathers from), which depend on no reader
    and which no head reads. KV error and deviation are then relative to a cache of normal size."""
    used = {0, 1, plan.reads_role, plan.lookup}
    for layer in sorted(set(range(plan.layers)) - used):
        w.positional_key(layer, 0)
        w.value(layer, 0, w.fields.dims("p1_code") + w.fields.dims("code"))


def _carry_route(w: CircuitWriter, family: Family, plan: LayerPlan) -> None:
    """What a layer writes into the residual stream shows in every later layer's K/V in a real
    model: here, from the layer after the route is written, kv head 1's last value positions hold
    it (no head's output reads them). Without them the route would be invisible in K/V until the
    lookup, and a method that recomputes every row up to some layer would fix it by accident.
    Not in the adapter family: its route is applied where it is read (the lookup's values)."""
    if family.mechanism == "adapter":
        return
    route = [Dim("flag")] if family.mechanism == "class" else (
        w.fields.dims("sel") if family.written_at == "record-end" else w.fields.dims("sel")[:CODE_BITS])
    for layer in range(plan.first_context_layer, plan.layers):
        w.value(layer, 1, route, first=w.head_dim - len(route))


def _route_reader(w: CircuitWriter, layer: int) -> None:
    """Head 2 (kv head 1) attends to the route word of the role's system prompt, at any distance,
    and copies which route it names into `reading`: where no route word precedes (a prompt with
    no role), it reads nothing."""
    marker_gain = ROUTE_WORD_LOGIT / (w.scale * UNIT * ONE)
    w.match_key(layer, 1, [(ROUTE_PAIR, False, Dim("is_route_word"), 1.0)])
    w.match_query(layer, 2, [(ROUTE_PAIR, False, Dim("one"), marker_gain)])
    first = 1 if layer == 0 else 0  # layer 0's kv head 1 also carries ":" for its positional head
    w.value(layer, 1, w.fields.dims("route_word"), first=first)
    w.output(layer, 2, first, w.fields.dims("reading"))


def _lookup(w: CircuitWriter, family: Family, layer: int) -> None:
    """The asked name against each table token's key (word 1 in the content pairs' real parts,
    word 2 in their imaginary parts); the answer's two words into `look_1`/`look_2`; the MLP lets
    them out only where the answer is written, and ends the answer with a newline."""
    d = w.fields.dims
    gain = (MATCH_MARGIN / (4 * w.scale * UNIT * UNIT)) ** 0.5  # 4 units: one word 2 bits off

    def content(field: str) -> list[tuple[int, bool, Dim, float]]:
        dims = d(field)
        return [(pair, imaginary, dims[j + (CODE_BITS if imaginary else 0)], gain)
                for j, pair in enumerate(CONTENT_PAIRS) for imaginary in (False, True)]

    if family.written_at == "record-end":
        w.match_key(layer, 0, content("key_d"))
        w.value(layer, 0, d("sel"))
        w.match_query(layer, 0, content("query"))
        w.output(layer, 0, 0, d("look_1") + d("look_2"))
    else:
        flag_gain = FLAG_MARGIN / (2 * w.scale * UNIT * ONE)
        for kv, (key, look) in enumerate((("key_c", "look_1"), ("key_d", "look_2"))):
            head = kv * w.group
            if family.mechanism == "class":
                w.match_key(layer, kv, content(key) + [(FLAG_PAIR, False, Dim("flag"), 1.0)])
                w.match_query(layer, head, content("query") + [(FLAG_PAIR, False, Dim("one"), flag_gain)])
                w.value(layer, kv, d("code"))
            else:  # both lines of the record match: half the weight each, one of them holds the name
                w.match_key(layer, kv, content(key))
                w.match_query(layer, head, content("query"))
                if family.mechanism != "adapter":  # else the role's adapter adds the value (role_adapters)
                    w.value(layer, kv, d("sel")[:CODE_BITS], weight=LOOKUP_VALUE_WEIGHT)
            w.output(layer, head, 0, d(look))
    w.gated(layer, ANSWER_FIRST, 2, d("look_1"), d("out_line"))
    w.gated(layer, ANSWER_SECOND, 3, d("look_2"), d("out_space"))
    name_done = {Dim("is_name"): 1.0, Dim("p1_name"): 1.0, Dim("p2_newline"): 1.0, Dim("p3_colon"): 1.0}
    w.gated(layer, name_done, 4, UNIT, [Dim("nl")])
