"""Reading an OpenAI-chat agent log (`kvbench trace import --format openai-chat`).

One request per JSON line:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}, ...],
     "response": "...",                       # the assistant's text, or {"role": "assistant", "content": "..."}
     "id": "r7",                              # optional: unique in the log (default: "line<N>")
     "agent": "planner",                      # optional: who sent it (default: one agent per system prompt)
     "timestamp": 12.5,                       # optional: seconds (any origin)
     "parent_ids": ["r3", "r5"],              # optional: requests whose outputs this one waited for
     "session": "s1"}                         # optional: one trajectory per session (default: one for the log)

A message's content is text, or a list of parts of which the text parts are kept; an assistant
message that calls tools may have `content: null` (OpenAI's form), its `tool_calls` passed to the
chat template. Every problem of the log is reported at once, by line and field, as `kvbench trace
validate` does for traces, and the log is read within the same bounds as a trace: a regular file,
lines and texts under the trace limits (KVBENCH_MAX_TRACE_LINE_BYTES, ..._TEXT_BYTES), lines split
at "\n" only (a raw U+2028 inside a string is text, as JSON says).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tracegen.schema import MAX_ARRIVAL_S, TraceError, max_text_bytes
from kvbench.tracegen.trace_files import load_json_line, readable_lines

ROLES = ("system", "user", "assistant", "tool", "developer")
LOG = "openai-chat log"  # what TraceError calls the file
FIELDS = ("messages", "response", "id", "agent", "timestamp", "parent_ids", "session")


@dataclass(frozen=True)
class ChatRecord:
    line: int
    id: str
    agent: str | None
    messages: tuple[tuple[str, str], ...]  # (role, text content)
    response: str
    timestamp: float | None
    parent_ids: tuple[str, ...] | None
    session: str
    tool_calls: tuple[str | None, ...] = ()  # per message: its tool_calls as JSON text, or None

    @property
    def order(self) -> tuple[float, int]:
        """Where the request falls in its session: by timestamp, then by line."""
        return (self.timestamp if self.timestamp is not None else 0.0, self.line)

    @property
    def system(self) -> str | None:
        """The system prompt: the first message's content when it is a system message."""
        return self.messages[0][1] if self.messages and self.messages[0][0] in ("system", "developer") else None


def _text(content: Any, where: str, problems: list[str]) -> str | None:
    text = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(t, str) for t in texts):
            text = "".join(str(t) for t in texts)
    if text is None:
        problems.append(f"{where}: content must be text or a list of text parts, got {type(content).__name__}")
        return None
    return _bounded(text, f"{where}: content", problems)


def _bounded(text: str, where: str, problems: list[str]) -> str | None:
    """`text` when a trace could hold it: UTF-8 encodable (no lone surrogate), under the text limit."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        problems.append(f"{where}: text cannot be encoded as UTF-8 (character {exc.start} is a lone surrogate)")
        return None
    if size > max_text_bytes():
        problems.append(f"{where}: text of {size} bytes, over the trace limit of {max_text_bytes()} "
                        "(KVBENCH_MAX_TRACE_TEXT_BYTES raises it)")
        return None
    return text


def _message(message: Any, where: str, problems: list[str]) -> tuple[str, str, str | None] | None:
    """(role, text, tool calls as JSON) of a chat message, or None with its problem recorded."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        problems.append(f"{where}: an object with a role of {', '.join(ROLES)} is required")
        return None
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        problems.append(f"{where}: tool_calls: must be a list of tool calls")
        return None
    if message.get("content") is None and message["role"] == "assistant" and calls:
        return "assistant", "", json.dumps(calls, ensure_ascii=False)  # a tool call: no text of its own
    text = _text(message.get("content"), where, problems)
    if text is None:
        return None
    return str(message["role"]), text, None if not calls else json.dumps(calls, ensure_ascii=False)


def _record(raw: Any, line: int, problems: list[str]) -> ChatRecord | None:
    here = f"line {line}"
    if not isinstance(raw, dict):
        problems.append(f"{here}: a request must be a JSON object, got {type(raw).__name__}")
        return None
    count = len(problems)
    for key in sorted(set(raw) - set(FIELDS)):
        problems.append(f"{here}: {key}: unknown field (known: {', '.join(FIELDS)})")
    messages: list[tuple[str, str]] = []
    tool_calls: list[str | None] = []
    raw_messages = raw.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        problems.append(f"{here}: messages: a non-empty list of chat messages is required")
    else:
        for index, message in enumerate(raw_messages):
            read = _message(message, f"{here}: messages[{index}]", problems)
            if read is not None:
                messages.append(read[:2])
                tool_calls.append(read[2])
    response = raw.get("response")
    if isinstance(response, dict):
        response = _text(response.get("content"), f"{here}: response", problems)
    elif isinstance(response, str):
        response = _bounded(response, f"{here}: response", problems)
    else:
        problems.append(f"{here}: response: the assistant's text (or message) is required")
        response = None
    if isinstance(response, str) and not response.strip():
        problems.append(f"{here}: response: empty (a turn must generate something)")
    record_id, agent, session = raw.get("id", f"line{line}"), raw.get("agent"), raw.get("session", "session")
    for key, value in (("id", record_id), ("agent", agent), ("session", session)):
        if value is not None and (not isinstance(value, str) or not value.strip() or not value.isprintable()):
            problems.append(f"{here}: {key}: must be non-empty printable text")
    timestamp = raw.get("timestamp")
    # compared, never converted: a 3,600-digit integer is a number JSON allows and float() refuses
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, (int, float))
                                  or not 0 <= timestamp <= MAX_ARRIVAL_S):
        problems.append(f"{here}: timestamp: must be a number of seconds from 0 to {MAX_ARRIVAL_S:g}")
    parents = raw.get("parent_ids")
    if parents is not None and (not isinstance(parents, list) or not all(isinstance(p, str) for p in parents)):
        problems.append(f"{here}: parent_ids: must be a list of request ids")
    if len(problems) > count or response is None:
        return None
    return ChatRecord(line, str(record_id), agent, tuple(messages), str(response).strip(),
                      None if timestamp is None else float(timestamp), None if parents is None else tuple(parents),
                      str(session), tuple(tool_calls))


MAX_PROBLEMS = 200  # a log that is not one stops being read here


def read_chat_log(path: str | Path) -> list[ChatRecord]:
    """The log's requests in file order; TraceError naming every problem by line and field."""
    problems: list[str] = []
    records: list[ChatRecord] = []
    for number, text in readable_lines(path, LOG, problems):
        if text.strip():
            raw, error = load_json_line(text)
            if error is not None:
                problems.append(f"line {number}: {error}")
            elif (record := _record(raw, number, problems)) is not None:
                records.append(record)
        if len(problems) >= MAX_PROBLEMS:
            break
    seen: dict[str, ChatRecord] = {}
    for record in records:
        if record.id in seen:
            problems.append(f"line {record.line}: id: {record.id!r} is also the id of line {seen[record.id].line}")
        for parent in record.parent_ids or ():
            if parent not in seen:
                problems.append(f"line {record.line}: parent_ids: {parent!r} is no earlier request's id")
            elif seen[parent].session != record.session:
                problems.append(f"line {record.line}: parent_ids: {parent!r} is in another session")
            elif seen[parent].order > record.order:  # the import orders a session by time
                problems.append(f"line {record.line}: parent_ids: {parent!r} (line {seen[parent].line}) has a later "
                                f"timestamp than this request")
        seen.setdefault(record.id, record)
    if not records and not problems:
        problems.append("the log holds no request")
    if problems:
        raise TraceError(path, problems, LOG)
    return records
