"""A kvbench trace from an OpenAI-chat agent log (tracegen/chat_log.py reads it).

Each request becomes a turn of its agent; each session a trajectory. Its prompt is the chat
template's rendering of its messages (plain text, messages apart by a blank line, for a model
without a template), cut into segments:

- the agent's system prompt (`pf: system`) and the template's text around messages (`pf: text`);
- an earlier request's response found verbatim in a message (`ph: out:<turn>`): the replayer
  feeds that turn's real output there. Without `parent_ids`, such a request becomes a parent;
  with them, only an ancestor's output is taken (another one stays text);
- a token run of at least `min_span_tokens` shared with an earlier request's message, at any
  position in either (`ph: s<k>`, text in the trajectory's `shared`): what a method reuses.

Shared spans are cut at token boundaries where the pieces tokenize alone as they do together; an
output is taken whole, so where the tokenizer merges a character across its ends (a blank line
before it) the built prompt differs from the log's by that token. `replay.import_check` names every
prompt kvbench builds from the trace that is not the log's token for token. The search compares
every pair of requests of a session: logs of hundreds of requests import in seconds, not logs of
millions.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.tracegen.chat_log import ChatRecord
from kvbench.tracegen.schema import (
    OUT_PREFIX,
    TRACE_FORMAT,
    TRACE_VERSION,
    Agent,
    Segment,
    SharedText,
    TraceHeader,
    Trajectory,
    Turn,
)
from kvbench.tracegen.token_spans import shared_spans
from kvbench.tracegen.tokenizer import TraceTokenizer

MIN_QUOTED_TOKENS = 4  # a shorter response ("OK") turns up in unrelated text: never taken as quoted


@dataclass
class Piece:
    kind: str  # "glue" (template text), "system", "content" (searchable), "shared" (ph key), "out" (ph out:turn)
    text: str
    key: str = ""


@dataclass
class _Request:
    record: ChatRecord
    turn_id: str
    agent: str
    pieces: list[Piece]
    response_tokens: int  # the response's length in tokens, counted once
    parents: set[str] = field(default_factory=set)  # record ids


def _render(record: ChatRecord, tokenizer: TraceTokenizer) -> list[Piece]:
    """The prompt as pieces: messages' contents and the text the chat template puts around them."""
    contents = [text for _, text in record.messages]
    system_first = record.system is not None
    kinds = ["system" if system_first and i == 0 else "content" for i in range(len(contents))]
    calls = record.tool_calls or (None,) * len(contents)
    template = tokenizer.chat
    if template is None:  # a tool call is written out as its JSON, after the message's text
        pieces = []
        for kind, text, call in zip(kinds, contents, calls):
            pieces += [Piece(kind, text), *([Piece("glue", call)] if call else []), Piece("glue", "\n\n")]
        return [p for p in pieces if p.text]
    messages = [{"role": r, "content": t, **({"tool_calls": json.loads(c)} if c else {})}
                for (r, t), c in zip(record.messages, calls)]
    rendered = str(template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    bos = getattr(template, "bos_token", None)
    if bos and tokenizer.prompt_prefix_ids and rendered.startswith(bos):
        rendered = rendered[len(bos):]
    pieces, at = [], 0
    for kind, text in zip(kinds, contents):
        found = rendered.find(text, at) if text else -1
        if found < 0:  # the template rewrote it: it stays template text (never shared)
            continue
        pieces += [Piece("glue", rendered[at:found]), Piece(kind, text)]
        at = found + len(text)
    pieces.append(Piece("glue", rendered[at:]))
    return [p for p in pieces if p.text]


def log_prompt_ids(record: ChatRecord, tokenizer: TraceTokenizer) -> list[int]:
    """The request's prompt as a server tokenizes it: its chat template's rendering; without a
    template, each message (and the blank lines between them) tokenized apart, as a template's
    special tokens keep messages apart."""
    pieces = _render(record, tokenizer)
    if tokenizer.chat is not None:
        return tokenizer.prompt_prefix_ids + tokenizer.encode("".join(p.text for p in pieces))
    return tokenizer.prompt_prefix_ids + [i for p in pieces for i in tokenizer.encode(p.text)]


def _split(pieces: list[Piece], index: int, start: int, stop: int, kind: str, key: str) -> None:
    piece = pieces[index]
    pieces[index:index + 1] = [p for p in (Piece(piece.kind, piece.text[:start]), Piece(kind, piece.text[start:stop], key),
                                           Piece(piece.kind, piece.text[stop:])) if p.text]


def _take_outputs(request: _Request, earlier: list[_Request], ancestors: set[str] | None) -> None:
    """Earlier responses found verbatim in this request's messages become `out:` pieces (longest first)."""
    for producer in sorted(earlier, key=lambda r: -len(r.record.response)):
        if ancestors is not None and producer.record.id not in ancestors:
            continue
        if producer.response_tokens < MIN_QUOTED_TOKENS:
            continue
        response = producer.record.response
        for index, piece in enumerate(request.pieces):
            at = piece.text.find(response) if piece.kind == "content" else -1
            if at >= 0:  # an output is taken whole even where the tokenizer merges across its ends
                _split(request.pieces, index, at, at + len(response), "out", producer.turn_id)
                if ancestors is None:  # no parent ids: what a request quotes it waited for
                    request.parents.add(producer.record.id)
                break


def _mark_shared(requests: list[_Request], tokenizer: TraceTokenizer, min_len: int) -> dict[str, str]:
    """Shared segments: the token runs of >= min_len that a request's messages share with another
    request's, at any position in either, cut stably (tracegen/token_spans.py) and keyed by
    their text in order of first appearance. Returns text -> key."""
    content = [(r, i) for r, request in enumerate(requests) for i, p in enumerate(request.pieces) if p.kind == "content"]
    spans = shared_spans([requests[r].pieces[i].text for r, i in content], [r for r, _ in content], tokenizer, min_len)
    cut: dict[tuple[int, int], list[tuple[int, int]]] = {place: ranges for place, ranges in zip(content, spans) if ranges}
    keys: dict[str, str] = {}
    for r, request in enumerate(requests):
        pieces: list[Piece] = []
        for i, piece in enumerate(request.pieces):
            at = 0
            for start, stop in cut.get((r, i), ()):
                text = piece.text[start:stop]
                key = keys.setdefault(text, f"s{len(keys) + 1}")
                pieces += [Piece("content", piece.text[at:start]), Piece("shared", text, key)]
                at = stop
            pieces.append(Piece(piece.kind, piece.text[at:], piece.key) if at else piece)
        request.pieces = [p for p in pieces if p.text]
    return keys


def _agent_key(record: ChatRecord, by_system: dict[str | None, str]) -> str:
    if record.agent is not None:
        return record.agent
    return by_system.setdefault(record.system, f"A{len(by_system)}")


def _trajectory(session: str, records: list[ChatRecord], tokenizer: TraceTokenizer, min_len: int,
                arrival_s: float) -> Trajectory:
    by_system: dict[str | None, str] = {}
    systems: dict[str, str] = {}
    counts: dict[str, int] = defaultdict(int)
    requests: list[_Request] = []
    by_id: dict[str, _Request] = {}
    for record in records:
        agent = _agent_key(record, by_system)
        systems.setdefault(agent, record.system or "")
        pieces = _render(record, tokenizer)
        for piece in pieces:  # a system prompt other than its agent's is the prompt's own text
            if piece.kind == "system" and piece.text != systems[agent]:
                piece.kind = "glue"
        request = _Request(record, f"{agent}.r{counts[agent]}", agent, pieces, len(tokenizer.encode(record.response)))
        counts[agent] += 1
        if record.parent_ids is not None:
            request.parents = set(record.parent_ids)
        ancestors = _ancestors(request, by_id) if record.parent_ids is not None else None
        _take_outputs(request, requests, ancestors)
        requests.append(request)
        by_id[record.id] = request
    keys = _mark_shared(requests, tokenizer, min_len)
    agents = {name: Agent(role=name, system=text, system_tokens=len(tokenizer.encode(text)))
              for name, text in systems.items()}
    shared = {key: SharedText(text=text, num_tokens=len(tokenizer.encode(text))) for text, key in keys.items()}
    turns = [Turn(turn_id=r.turn_id, agent=r.agent, after=sorted(by_id[p].turn_id for p in r.parents),
                  max_tokens=max(1, r.response_tokens), segments=_segments(r, tokenizer))
             for r in requests]
    return Trajectory(trajectory_id=session, arrival_s=arrival_s, agents=agents, shared=shared, turns=turns)


def _ancestors(request: _Request, by_id: dict[str, _Request]) -> set[str]:
    seen: set[str] = set()
    stack = list(request.parents)
    while stack:
        record_id = stack.pop()
        if record_id not in seen:
            seen.add(record_id)
            stack += by_id[record_id].parents
    return seen


def _segments(request: _Request, tokenizer: TraceTokenizer) -> list[Segment]:
    segments: list[Segment] = []
    text = ""
    for piece in request.pieces:
        if piece.kind in ("glue", "content") and (tokenizer.chat is not None or not text):
            text += piece.text  # with a template, one text; without, each message's text apart (log_prompt_ids)
            continue
        if text:
            segments.append(Segment(pf="text", text=text, num_tokens=len(tokenizer.encode(text))))
            text = ""
        if piece.kind in ("glue", "content"):
            text = piece.text
            continue
        if piece.kind == "system":
            segments.append(Segment(pf="system"))
        else:
            segments.append(Segment(ph=OUT_PREFIX + piece.key if piece.kind == "out" else piece.key))
    if text:
        segments.append(Segment(pf="text", text=text, num_tokens=len(tokenizer.encode(text))))
    return segments


def chat_log_trace(records: list[ChatRecord], tokenizer: TraceTokenizer, min_span_tokens: int = 32,
                   source: str | Path = "") -> tuple[TraceHeader, list[Trajectory]]:
    """The trace of a log: one trajectory per session, arriving when its first request did."""
    sessions: dict[str, list[ChatRecord]] = defaultdict(list)
    for record in records:
        sessions[record.session].append(record)
    origin = min((r.timestamp for r in records if r.timestamp is not None), default=0.0)
    trajectories = []
    for session, members in sessions.items():
        members.sort(key=lambda r: r.order)
        first = members[0].timestamp
        trajectories.append(_trajectory(session, members, tokenizer, min_span_tokens,
                                        0.0 if first is None else first - origin))
    trajectories.sort(key=lambda t: t.arrival_s)
    header = TraceHeader(format=TRACE_FORMAT, version=TRACE_VERSION,
                         generator={"name": "kvbench trace import", "format": "openai-chat", "log": str(source),
                                    "min_span_tokens": min_span_tokens, "chat_template": tokenizer.chat is not None,
                                    "kvbench_version": __version__},
                         tokenizer=tokenizer.name, tokenizer_sha256=tokenizer.sha256,
                         prompt_prefix_ids=tokenizer.prompt_prefix_ids)
    return header, trajectories


def describe(trajectories: list[Trajectory]) -> dict[str, Any]:
    """What the import found: turns, agents, shared segments and their tokens, dependencies."""
    return {"trajectories": len(trajectories), "turns": sum(len(t.turns) for t in trajectories),
            "agents": sorted({a for t in trajectories for a in t.agents}),
            "shared_segments": sum(len(t.shared) for t in trajectories),
            "shared_tokens": sum(s.num_tokens for t in trajectories for s in t.shared.values()),
            "output_reuses": sum(1 for t in trajectories for turn in t.turns for s in turn.segments
                                 if s.ph and s.ph.startswith(OUT_PREFIX)),
            "dependencies": sum(len(turn.after) for t in trajectories for turn in t.turns)}
