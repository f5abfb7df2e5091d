"""A seeded mutator of kvbench traces, for fuzzing the reader, the validator and the replayer.

Each mutation starts from a valid trace and breaks it one way a hand-edited, truncated,
machine-written or hostile file can be broken: a field deleted, a value of another type,
numeric extremes, unicode junk, truncation, lines and lists reordered, huge and deep
structures. Written for kvbench's schema (hypothesis would have to learn the structure first).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

JUNK_STRINGS = ["", " ", "\u0000", "\ud800", "\udfff", "🙂" * 3, "\u202e\u202d", "e\u0301" * 5, "\n\n", "\\",
                "\"}", "x" * 100_000, "ünïcödé", "A0", "out:A0.r0", "out:", "q", "system", "text", "null"]
EXTREME_NUMBERS: list[Any] = [0, -1, 1, 2**31, 2**63, 10**12, 10**400, -0.0, 0.5, 1e308, -1e308, 1e-320, 7.0]
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-0", "00", "1.", ".5", "0x10"]
# The reading limits a fuzz run sets, small enough that `oversize` mutations cross them.
OVERSIZE_LIMITS = {"KVBENCH_MAX_TRACE_TEXT_BYTES": "4096", "KVBENCH_MAX_TRACE_LINE_BYTES": "65536"}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _paths(item, (*prefix, index))
    return paths


def _get(root: Any, path: tuple) -> Any:
    for part in path:
        root = root[part]
    return root


def _set(root: Any, path: tuple, value: Any) -> None:
    _get(root, path[:-1])[path[-1]] = value


def _other_type(rng: random.Random, value: Any) -> Any:
    choices: list[Any] = [None, True, 3, 2.5, "text", [], {}, [1, "a"], {"k": "v"}]
    return rng.choice([c for c in choices if type(c) is not type(value)])


class TraceMutator:
    def __init__(self, lines: list[dict[str, Any]]) -> None:
        self.lines = lines  # the header, then one trajectory per line, as parsed JSON

    def mutate(self, seed: int) -> tuple[str, bytes]:
        """(what was done, the mutated file) for one seed."""
        rng = random.Random(seed)
        name, mutation = rng.choice(list(self._mutations().items()))
        lines = json.loads(json.dumps(self.lines))
        return name, mutation(rng, lines)

    def _mutations(self) -> dict[str, Callable[[random.Random, list[Any]], bytes]]:
        return {"delete field": self._delete, "swap type": self._swap_type, "extreme number": self._extreme,
                "raw number": self._raw_number, "junk string": self._junk, "truncate": self._truncate,
                "reorder": self._reorder, "swap lines": self._swap_lines, "huge": self._huge, "deep": self._deep,
                "flip bytes": self._flip_bytes, "rename turn": self._rename_turn, "duplicate": self._duplicate,
                "several": self._several, "lax type": self._lax_type, "duplicate key": self._duplicate_key,
                "oversize": self._oversize}

    @staticmethod
    def _dump(lines: list[Any]) -> bytes:
        return "".join(json.dumps(line) + "\n" for line in lines).encode()

    @staticmethod
    def _pick(rng: random.Random, lines: list[Any], want: Callable[[Any], bool] = lambda _: True) -> tuple | None:
        candidates = [(i, *p) for i, line in enumerate(lines) for p in _paths(line) if p and want(_get(line, p))]
        return rng.choice(candidates) if candidates else None

    def _delete(self, rng: random.Random, lines: list[Any]) -> bytes:
        path = self._pick(rng, lines)
        if path is not None:
            parent = _get(lines, path[:-1])
            del parent[path[-1]]
        return self._dump(lines)

    def _swap_type(self, rng: random.Random, lines: list[Any]) -> bytes:
        path = self._pick(rng, lines)
        if path is not None:
            _set(lines, path, _other_type(rng, _get(lines, path)))
        return self._dump(lines)

    def _extreme(self, rng: random.Random, lines: list[Any]) -> bytes:
        path = self._pick(rng, lines, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        if path is not None:
            _set(lines, path, rng.choice(EXTREME_NUMBERS))
        return self._dump(lines)

    def _raw_number(self, rng: random.Random, lines: list[Any]) -> bytes:
        marker = "__kvbench_raw__"
        path = self._pick(rng, lines, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        if path is not None:
            _set(lines, path, marker)
        return self._dump(lines).replace(f'"{marker}"'.encode(), rng.choice(RAW_NUMBERS).encode())

    def _junk(self, rng: random.Random, lines: list[Any]) -> bytes:
        path = self._pick(rng, lines, lambda v: isinstance(v, str))
        if path is not None:
            text = _get(lines, path)
            at = rng.randrange(len(text) + 1)
            _set(lines, path, text[:at] + rng.choice(JUNK_STRINGS) + text[at:])
        return self._dump(lines)

    def _truncate(self, rng: random.Random, lines: list[Any]) -> bytes:
        data = self._dump(lines)
        return data[: rng.randrange(len(data))]

    def _reorder(self, rng: random.Random, lines: list[Any]) -> bytes:
        path = self._pick(rng, lines, lambda v: isinstance(v, list) and len(v) > 1)
        if path is not None:
            rng.shuffle(_get(lines, path))
        return self._dump(lines)

    def _swap_lines(self, rng: random.Random, lines: list[Any]) -> bytes:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return self._dump(lines)

    def _huge(self, rng: random.Random, lines: list[Any]) -> bytes:
        trajectory = rng.choice(lines[1:])
        turn = trajectory["turns"][-1]
        shape = rng.random()
        if shape < 0.3:  # a long chain, each turn after the one before
            for index in range(rng.choice([40, 150])):
                trajectory["turns"].append({**turn, "turn_id": f"extra{index}", "after": [turn["turn_id"]]})
                turn = trajectory["turns"][-1]
        elif shape < 0.5:  # a wide fan-out, every turn after the same one
            trajectory["turns"] += [{**turn, "turn_id": f"extra{i}", "after": [turn["turn_id"]]} for i in range(150)]
        else:  # many segments
            turn["segments"] = turn["segments"] * rng.choice([100, 1000])
        return self._dump(lines)

    def _deep(self, rng: random.Random, lines: list[Any]) -> bytes:
        depth = rng.choice([50, 900, 5000, 50_000])
        path = self._pick(rng, lines)
        text = self._dump(lines).decode()
        if path is None:
            return text.encode()
        marker = "__kvbench_deep__"
        _set(lines, path, marker)
        return self._dump(lines).replace(f'"{marker}"'.encode(), ("[" * depth + "]" * depth).encode())

    def _flip_bytes(self, rng: random.Random, lines: list[Any]) -> bytes:
        data = bytearray(self._dump(lines))
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)

    def _rename_turn(self, rng: random.Random, lines: list[Any]) -> bytes:
        trajectory = rng.choice(lines[1:])
        turn = rng.choice(trajectory["turns"])
        turn["turn_id"] = rng.choice(["", "A0.r0", "x" * 300, turn["turn_id"] + "'", "out:A0.r0", "\ud800"])
        return self._dump(lines)

    def _duplicate(self, rng: random.Random, lines: list[Any]) -> bytes:
        index = rng.randrange(len(lines))
        lines.insert(rng.randrange(len(lines) + 1), json.loads(json.dumps(lines[index])))
        return self._dump(lines)

    def _lax_type(self, rng: random.Random, lines: list[Any]) -> bytes:
        """A number written as JSON's true/false or as a string ("4"): what a lax reader coerces."""
        path = self._pick(rng, lines, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        if path is not None:
            value = _get(lines, path)
            _set(lines, path, rng.choice([True, False, str(value), f" {value}", "1e3"]))
        return self._dump(lines)

    def _duplicate_key(self, rng: random.Random, lines: list[Any]) -> bytes:
        """An object with one key given twice (json.dumps cannot write it: spliced in as text)."""
        path = self._pick(rng, lines, lambda v: isinstance(v, dict) and bool(v))
        if path is None:
            return self._dump(lines)
        obj = _get(lines, path)
        key = rng.choice(list(obj))
        marker = "__kvbench_dup__"
        obj[marker] = rng.choice([obj[key], _other_type(rng, obj[key])])
        dumped = self._dump(lines).decode()
        return dumped.replace(json.dumps(marker), json.dumps(key), 1).encode()

    def _oversize(self, rng: random.Random, lines: list[Any]) -> bytes:
        """A text or a whole line past the reading limits the fuzz run sets (OVERSIZE_LIMITS)."""
        path = self._pick(rng, lines, lambda v: isinstance(v, str))
        if path is not None:
            _set(lines, path, _get(lines, path) + "ü" * rng.choice([3000, 40_000]))
        return self._dump(lines)

    def _several(self, rng: random.Random, lines: list[Any]) -> bytes:
        for _ in range(rng.randint(2, 4)):
            mutation = rng.choice([self._delete, self._swap_type, self._extreme, self._junk, self._reorder])
            lines = [json.loads(line) for line in mutation(rng, lines).decode().splitlines()]
        return self._dump(lines)
