"""Reading an OpenAI-chat agent log (`kvbench trace import --format openai-chat`).

One request per JSON line:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}, ...],
     "response": "...",                       # the assistant's text, or {"role": "assistant", "content": "..."}
     "id": "r7",                              # optional: unique in the log (default: "line<N>")
     "agent": "planner",                      # optional: who sent it (default: one agent per system prompt)
     "timestamp": 12.5,                       # optional: seconds (any origin)
     "parent_ids": ["r3", "r5"],              # optional: requests whose outputs this one waited for
     "session": "s1"}                         # optional: one trajectory per session (default: one for the log)

A message's content is text, or a list of parts of which the text parts are kept. Every problem
of the log is reported at once, by line and field, as `kvbench trace validate` does for traces.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tracegen.schema import TraceError

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

    @property
    def system(self) -> str | None:
        """The system prompt: the first message's content when it is a system message."""
        return self.messages[0][1] if self.messages and self.messages[0][0] in ("system", "developer") else None


def _text(content: Any, where: str, problems: list[str]) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(str(t) for t in texts)
    problems.append(f"{where}: content must be text or a list of text parts, got {type(content).__name__}")
    return None


def _record(raw: Any, line: int, problems: list[str]) -> ChatRecord | None:
    here = f"line {line}"
    if not isinstance(raw, dict):
        problems.append(f"{here}: a request must be a JSON object, got {type(raw).__name__}")
        return None
    count = len(problems)
    for key in sorted(set(raw) - set(FIELDS)):
        problems.append(f"{here}: {key}: unknown field (known: {', '.join(FIELDS)})")
    messages: list[tuple[str, str]] = []
    raw_messages = raw.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        problems.append(f"{here}: messages: a non-empty list of chat messages is required")
    else:
        for index, message in enumerate(raw_messages):
            where = f"{here}: messages[{index}]"
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                problems.append(f"{where}: an object with a role of {', '.join(ROLES)} is required")
                continue
            text = _text(message.get("content"), where, problems)
            if text is not None:
                messages.append((str(message["role"]), text))
    response = raw.get("response")
    if isinstance(response, dict):
        response = _text(response.get("content"), f"{here}: response", problems)
    elif not isinstance(response, str):
        problems.append(f"{here}: response: the assistant's text (or message) is required")
        response = None
    if isinstance(response, str) and not response.strip():
        problems.append(f"{here}: response: empty (a turn must generate something)")
    record_id, agent, session = raw.get("id", f"line{line}"), raw.get("agent"), raw.get("session", "session")
    for key, value in (("id", record_id), ("agent", agent), ("session", session)):
        if value is not None and (not isinstance(value, str) or not value.strip() or not value.isprintable()):
            problems.append(f"{here}: {key}: must be non-empty printable text")
    timestamp = raw.get("timestamp")
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, (int, float))
                                  or not math.isfinite(timestamp) or timestamp < 0):
        problems.append(f"{here}: timestamp: must be a number of seconds >= 0")
    parents = raw.get("parent_ids")
    if parents is not None and (not isinstance(parents, list) or not all(isinstance(p, str) for p in parents)):
        problems.append(f"{here}: parent_ids: must be a list of request ids")
    if len(problems) > count or response is None:
        return None
    return ChatRecord(line, str(record_id), agent, tuple(messages), str(response).strip(),
                      None if timestamp is None else float(timestamp), None if parents is None else tuple(parents),
                      str(session))


def read_chat_log(path: str | Path) -> list[ChatRecord]:
    """The log's requests in file order; TraceError naming every problem by line and field."""
    problems: list[str] = []
    records: list[ChatRecord] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, [f"cannot read the log: {exc}"], LOG) from None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        record = _record(raw, number, problems)
        if record is not None:
            records.append(record)
    seen: dict[str, ChatRecord] = {}
    for record in records:
        if record.id in seen:
            problems.append(f"line {record.line}: id: {record.id!r} is also the id of line {seen[record.id].line}")
        for parent in record.parent_ids or ():
            if parent not in seen:
                problems.append(f"line {record.line}: parent_ids: {parent!r} is no earlier request's id")
            elif seen[parent].session != record.session:
                problems.append(f"line {record.line}: parent_ids: {parent!r} is in another session")
        seen.setdefault(record.id, record)
    if not records and not problems:
        problems.append("the log holds no request")
    if problems:
        raise TraceError(path, problems, LOG)
    return records
