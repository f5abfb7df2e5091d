"""Token runs that texts of different owners share, found in time linear in their tokens.

Used by the openai-chat import (tracegen/chat_import.py): which stretches of the requests'
messages another request's messages hold too, at any position, so they become shared segments.

How: every run of `min_len` tokens (a k-gram, hashed) is mapped to the set of owners whose texts
hold it; a token's *signature* is the union of those sets over the k-grams that cover it. A
stretch that owners A and B share has signature {A, B} on all of its tokens, and the tokens
around it (covered only by k-grams that cross into text one of them lacks) another, so a text is
cut exactly where its signature changes, and the cuts depend only on the content: the same
stretch is cut the same way in every text that holds it, whatever surrounds it. Stretches of at
least `min_len` tokens that two or more owners share are the spans. No pair of texts is ever
compared, so a log of a thousand requests costs a thousand times one, not half a million.

A cut must also be stable: the text's two sides must tokenize alone as they do together, or the
prompt built from the pieces would not be the log's. A span's ends move inward, by the same
characters in every text holding it, until they are stable in all of them.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.tracegen.tokenizer import TraceTokenizer

_HASH_BASE = np.uint64(1_000_003)
STABILITY_WINDOW = 16  # tokens each side of a cut tokenized to check it; the whole text when that fails


@dataclass(frozen=True)
class _Text:
    text: str
    ids: np.ndarray
    starts: list[int]  # each token's first character
    owner: int


def _gram_hashes(ids: np.ndarray, k: int) -> np.ndarray:
    """A 64-bit polynomial hash of every run of k tokens (wrapping arithmetic)."""
    count = len(ids) - k + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    if count <= 0:
        return hashes
    values = ids.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        for j in range(k):
            hashes = hashes * _HASH_BASE + values[j:j + count]
    return hashes


class _Sets:
    """Owner sets by small integer id, with memoized unions (-1: a text's owner alone)."""

    def __init__(self) -> None:
        self.sets: list[frozenset[int]] = []
        self.ids: dict[frozenset[int], int] = {}
        self.unions: dict[tuple[int, int], int] = {}

    def id_of(self, owners: frozenset[int]) -> int:
        if owners not in self.ids:
            self.ids[owners] = len(self.sets)
            self.sets.append(owners)
        return self.ids[owners]

    def union(self, a: int, b: int) -> int:
        if a == b or b == -1:
            return a
        if a == -1:
            return b
        key = (a, b) if a < b else (b, a)
        if key not in self.unions:
            self.unions[key] = self.id_of(self.sets[a] | self.sets[b])
        return self.unions[key]


def _gram_sets(texts: list[_Text], k: int, sets: _Sets) -> list[np.ndarray]:
    """Per text, the owner-set id of each k-gram starting there (-1 when only its owner holds it)."""
    hashes = [_gram_hashes(t.ids, k) for t in texts]
    if not any(len(h) for h in hashes):
        return hashes
    every = np.concatenate(hashes)
    owners = np.concatenate([np.full(len(h), t.owner, dtype=np.int64) for h, t in zip(hashes, texts)])
    order = np.lexsort((owners, every))
    every, owners = every[order], owners[order]
    distinct_pair = np.ones(len(every), dtype=bool)
    distinct_pair[1:] = (every[1:] != every[:-1]) | (owners[1:] != owners[:-1])
    every, owners = every[distinct_pair], owners[distinct_pair]
    group_start = np.flatnonzero(np.r_[True, every[1:] != every[:-1]])
    group_size = np.diff(np.r_[group_start, len(every)])
    shared = group_size > 1
    keys = every[group_start[shared]]  # sorted, as `every` is
    values = np.array([sets.id_of(frozenset(owners[start:start + size].tolist()))
                       for start, size in zip(group_start[shared].tolist(), group_size[shared].tolist())], dtype=np.int64)
    result = []
    for h in hashes:
        ids = np.full(len(h), -1, dtype=np.int64)
        if len(keys):
            where = np.minimum(np.searchsorted(keys, h), len(keys) - 1)
            found = keys[where] == h
            ids[found] = values[where[found]]
        result.append(ids)
    return result


def _token_signatures(gram_ids: np.ndarray, tokens: int, k: int, sets: _Sets) -> np.ndarray:
    """Each token's signature: the union of the owner sets of the k-grams covering it."""
    signature = np.full(tokens, -1, dtype=np.int64)
    grams = len(gram_ids)
    if grams == 0:
        return signature
    # runs of equal gram ids; a token whose covering grams lie in one run takes its id
    run_start = np.flatnonzero(np.r_[True, gram_ids[1:] != gram_ids[:-1]])
    positions = np.arange(tokens)
    low = np.clip(positions - k + 1, 0, grams - 1)
    high = np.clip(positions, 0, grams - 1)
    low_run = np.searchsorted(run_start, low, side="right") - 1
    high_run = np.searchsorted(run_start, high, side="right") - 1
    signature[:] = gram_ids[run_start[low_run]]
    for token in np.flatnonzero(low_run != high_run).tolist():
        value = -1
        for run in range(low_run[token], high_run[token] + 1):
            value = sets.union(value, int(gram_ids[run_start[run]]))
        signature[token] = value
    return signature


class _Stability:
    """Whether cutting a text at a character keeps its tokens (cached per text and cut)."""

    def __init__(self, tokenizer: TraceTokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[tuple[int, int], bool] = {}

    def stable(self, index: int, text: _Text, cut: int) -> bool:
        if (index, cut) not in self.cache:
            self.cache[(index, cut)] = self._stable(text, cut)
        return self.cache[(index, cut)]

    def _stable(self, text: _Text, cut: int) -> bool:
        token = _token_at(text, cut)
        if token is None:
            return False  # inside a token: no cut keeps it
        encode = self.tokenizer.encode
        low, high = max(0, token - STABILITY_WINDOW), min(len(text.starts), token + STABILITY_WINDOW)
        left = text.starts[low]
        right = text.starts[high] if high < len(text.starts) else len(text.text)
        window = text.ids[low:high].tolist()
        if encode(text.text[left:cut]) + encode(text.text[cut:right]) == window:
            return True
        return encode(text.text[:cut]) + encode(text.text[cut:]) == text.ids.tolist()  # the whole text decides


def _token_at(text: _Text, cut: int) -> int | None:
    """The token starting at character `cut` (len(starts) at the text's end), or None."""
    if cut == len(text.text):
        return len(text.starts)
    token = bisect.bisect_left(text.starts, cut)
    return token if token < len(text.starts) and text.starts[token] == cut else None


def _regions(signature: np.ndarray, min_len: int) -> list[tuple[int, int]]:
    """Token ranges of constant, shared signature at least min_len long."""
    if not len(signature):
        return []
    starts = np.flatnonzero(np.r_[True, signature[1:] != signature[:-1]])
    stops = np.r_[starts[1:], len(signature)]
    return [(int(a), int(b)) for a, b in zip(starts, stops) if signature[a] != -1 and b - a >= min_len]


def shared_spans(texts: Sequence[str], owners: Sequence[int], tokenizer: TraceTokenizer,
                 min_len: int) -> list[list[tuple[int, int]]]:
    """For each text, the character ranges (start, stop), in order and disjoint, of the token runs
    of at least `min_len` tokens that a text of another owner holds too, cut stably; a range's
    text is the same in every text holding it."""
    encoded: dict[str, Any] = {}
    items = []
    for text, owner in zip(texts, owners):
        if text not in encoded:
            encoded[text] = tokenizer.backend.encode(text, add_special_tokens=False)
        encoding = encoded[text]
        items.append(_Text(text, np.asarray(encoding.ids, dtype=np.int64), [o[0] for o in encoding.offsets], owner))
    sets = _Sets()
    gram_ids = _gram_sets(items, min_len, sets)
    # candidate regions grouped by their text: the holders of one stretch
    holders: dict[str, list[tuple[int, int]]] = defaultdict(list)  # region text -> (text index, start char)
    for index, (item, grams) in enumerate(zip(items, gram_ids)):
        for a, b in _regions(_token_signatures(grams, len(item.ids), min_len, sets), min_len):
            start = item.starts[a]
            stop = item.starts[b] if b < len(item.starts) else len(item.text)
            holders[item.text[start:stop]].append((index, start))
    stability = _Stability(tokenizer)
    spans: list[list[tuple[int, int]]] = [[] for _ in items]
    for region, places in holders.items():
        if len({items[i].owner for i, _ in places}) < 2:
            continue
        first_index, first_start = places[0]
        first = items[first_index]
        # cut candidates: the first holder's token starts inside the region, relative to it
        inside = first.starts[bisect.bisect_left(first.starts, first_start):
                              bisect.bisect_left(first.starts, first_start + len(region))]
        inner = [s - first_start for s in inside] + [len(region)]

        def stable_everywhere(relative: int, places: list[tuple[int, int]]) -> bool:
            return all(stability.stable(i, items[i], start + relative) for i, start in places)

        begin = next((c for c in inner if stable_everywhere(c, places)), None)
        end = next((c for c in reversed(inner) if stable_everywhere(c, places)), None)
        if begin is None or end is None or end <= begin:
            continue
        piece = region[begin:end]
        if len(tokenizer.encode(piece)) < min_len:
            continue
        for i, start in places:
            spans[i].append((start + begin, start + end))
    return [sorted(s) for s in spans]
