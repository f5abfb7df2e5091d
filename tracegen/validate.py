"""What a trace promises about its tokenizer, checked against the tokenizer itself.

The schema (`tracegen.schema`) checks structure; this checks what replay relies on beyond it:
the header names the tokenizer the replay loads (same vocabulary), every text can be encoded,
and every declared token count is what that tokenizer gives for the text. `kvbench trace validate`
and `kvbench replay` run the same checks, so a trace that validates replays.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvbench.run_files import write_atomic
from kvbench.tracegen.schema import Trace, TraceError, TraceHeader, Trajectory
from kvbench.tracegen.tokenizer import TraceTokenizer, load_tokenizer
from kvbench.tracegen.trace_files import read_trace, write_trace


def tokenizer_problems(trace: Trace, tokenizer: TraceTokenizer) -> list[str]:
    """The header's tokenizer against the one that will count and build prompts."""
    header = trace.header
    if header.tokenizer_sha256 and header.tokenizer_sha256 != tokenizer.sha256:
        return [f"line 1: tokenizer_sha256: the trace was made with tokenizer {header.tokenizer!r} "
                f"(vocabulary sha256 {header.tokenizer_sha256[:12]}...), but {tokenizer.name!r} has "
                f"vocabulary sha256 {tokenizer.sha256[:12]}...; regenerate the trace with "
                f"`kvbench gen-trace --model {tokenizer.name}`, or pass the model it was made for"]
    if list(header.prompt_prefix_ids) != list(tokenizer.prompt_prefix_ids):
        return [f"line 1: prompt_prefix_ids: the trace says {header.prompt_prefix_ids}, tokenizer "
                f"{tokenizer.name!r} starts prompts with {tokenizer.prompt_prefix_ids}"]
    return []


def _texts(trajectory: Trajectory) -> Iterator[tuple[str, str, str, int]]:
    """(text field, count field, text, declared count) of every text prompts are built from."""
    for name, agent in trajectory.agents.items():
        yield f"agents.{name}.system", f"agents.{name}.system_tokens", agent.system, agent.system_tokens
    for key, shared in trajectory.shared.items():
        yield f"shared.{key}.text", f"shared.{key}.num_tokens", shared.text, shared.num_tokens
    for i, turn in enumerate(trajectory.turns):
        for k, segment in enumerate(turn.segments):
            if segment.pf == "text":
                where = f"turns[{i}].segments[{k}]"
                yield f"{where}.text", f"{where}.num_tokens", segment.text or "", segment.num_tokens or 0


def _unencodable(text: str) -> int | None:
    """Index of the first character UTF-8 cannot encode (a lone surrogate), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def token_count_problems(trace: Trace, tokenizer: TraceTokenizer) -> list[str]:
    """Texts that cannot be encoded, and declared token counts that differ from the tokenizer's."""
    problems: list[str] = []
    counts: dict[str, int] = {}  # system prompts and glue repeat across trajectories
    for index, trajectory in enumerate(trace.trajectories):
        line = trace.line_of(index)
        fields = list(_texts(trajectory))
        todo = []
        for text_field, _, text, _ in fields:
            if (bad := _unencodable(text)) is not None:
                problems.append(f"line {line}: {text_field}: text cannot be encoded as UTF-8 (character {bad} "
                                f"is {text[bad]!r}, a lone surrogate)")
            elif text not in counts:
                todo.append(text)
        for text, ids in zip(todo, tokenizer.encode_batch(todo)):
            counts[text] = len(ids)
        for _, count_field, text, declared in fields:
            actual = counts.get(text)
            if actual is not None and actual != declared:
                problems.append(f"line {line}: {count_field}: declares {declared} tokens, the text has {actual} "
                                f"under tokenizer {tokenizer.name!r}")
    return problems


def length_problems(trace: Trace, max_model_len: int) -> list[str]:
    """Turns that cannot fit a served context of `max_model_len` tokens: the prompt (with every
    upstream output at its max_tokens, and the tokenizer's prefix) plus the turn's max_tokens."""
    prefix, problems = len(trace.header.prompt_prefix_ids), []
    for index, trajectory in enumerate(trace.trajectories):
        for i, turn in enumerate(trajectory.turns):
            if (need := prefix + trajectory.prompt_tokens(turn) + turn.max_tokens) > max_model_len:
                problems.append(f"line {trace.line_of(index)}: turns[{i}] ({turn.turn_id}): needs {need} tokens "
                                f"(prompt + max_tokens), more than max_model_len {max_model_len}")
    return problems


def context_problem(trace: Trace, limit: int, model: str, shared_tokens: int | None) -> str | None:
    """Why a trace's turns do not fit the model's context of `limit` tokens, naming the first such
    turn and, for a generated context of `shared_tokens` (every prompt holds it once), the largest
    that fits; None when they all fit."""
    problems = length_problems(trace, limit)
    if not problems:
        return None
    prefix = len(trace.header.prompt_prefix_ids)
    need = max(prefix + t.prompt_tokens(turn) + turn.max_tokens for t in trace.trajectories for turn in t.turns)
    if shared_tokens and (fits := shared_tokens - (need - limit)) > 0:
        hint = f"; the largest --shared-tokens that fits is {fits:,}" + (
            f" ({fits // 256 * 256:,} in steps of 256)" if fits >= 256 else "")
    else:
        hint = "; a smaller --output-len lowers each turn's need"
    return (f"{len(problems)} turns do not fit {model}'s context of {limit:,} tokens (the prompt with every upstream "
            f"output at --output-len, plus its own --output-len); first: {problems[0].split(': ', 1)[1]}{hint}")


def check_trace(trace: Trace, tokenizer: TraceTokenizer, path: str = "<trace>") -> None:
    """Raise one TraceError listing every tokenizer problem of a structurally valid trace."""
    problems = tokenizer_problems(trace, tokenizer)
    if not problems:  # counts under another vocabulary would only repeat the mismatch
        problems = token_count_problems(trace, tokenizer)
    if problems:
        raise TraceError(path, problems)


def checked_tokenizer(trace: Trace, model: str | None, path: str | Path) -> TraceTokenizer:
    """The tokenizer replay uses for `trace` (`model`'s, else the one the header names), checked
    against every promise the trace makes about it; one TraceError lists what differs."""
    name = model if model is not None else trace.header.tokenizer
    try:
        tokenizer = load_tokenizer(name)
    except (ValueError, OSError) as exc:
        raise TraceError(path, [f"line 1: tokenizer: cannot load tokenizer {name!r} ({exc}); "
                                "pass --model with the model the trace was made for"]) from None
    check_trace(trace, tokenizer, str(path))
    return tokenizer


def write_validated_trace(path: str | Path, header: TraceHeader, trajectories: list[Trajectory],
                          tokenizer: TraceTokenizer) -> int:
    """Write a trace only if it reads back and validates as `trace validate` checks it: written
    beside `path`, read back, checked, then moved into place; on any problem nothing is left
    (TraceError names it). Returns its size in bytes."""
    target = Path(path)
    sizes: list[int] = []

    def write_checked(temporary: Path) -> None:
        sizes.append(write_trace(temporary, header, trajectories))
        check_trace(read_trace(temporary), tokenizer, str(target))

    write_atomic(target, write_checked)
    return sizes[0]
