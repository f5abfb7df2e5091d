"""Shared token runs across texts (tracegen/token_spans.py), with span lengths known exactly: each
text is built from words that are one token each, so a run's length in tokens is its word count."""

from __future__ import annotations

import pytest

from kvbench.tracegen.token_spans import shared_spans
from kvbench.tracegen.tokenizer import TraceTokenizer, load_tokenizer

MIN_LEN = 8


@pytest.fixture(scope="module")
def tokenizer() -> TraceTokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def words(tokenizer: TraceTokenizer) -> list[str]:
    """Words (with their leading space) that are one token alone and in any sequence of them."""
    found = []
    for index in sorted(tokenizer.backend.get_vocab().values()):
        text = tokenizer.backend.decode([index])
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower() and len(text) >= 5 \
                and tokenizer.encode(text) == [index]:
            found.append(text)
    assert len(found) >= 200
    return found


def _text(tokenizer: TraceTokenizer, *parts: list[str]) -> str:
    text = "".join(w for part in parts for w in part)
    assert len(tokenizer.encode(text)) == sum(len(p) for p in parts)  # one token per word, as built
    return text


def _span_texts(texts: list[str], spans: list[list[tuple[int, int]]]) -> list[list[str]]:
    return [[text[a:b] for a, b in ranges] for text, ranges in zip(texts, spans)]


@pytest.mark.parametrize("length", [MIN_LEN, MIN_LEN + 5])
def test_a_run_of_at_least_the_minimum_is_found_whole(tokenizer: TraceTokenizer, words: list[str], length: int) -> None:
    shared = words[100:100 + length]
    a = _text(tokenizer, words[0:5], shared, words[10:14])
    b = _text(tokenizer, words[20:23], shared, words[30:36])
    spans = shared_spans([a, b], [0, 1], tokenizer, MIN_LEN)
    assert _span_texts([a, b], spans) == [["".join(shared)], ["".join(shared)]]
    assert [len(tokenizer.encode(a[s:e])) for s, e in spans[0]] == [length]  # not a token more or less


def test_a_run_one_token_short_of_the_minimum_is_not(tokenizer: TraceTokenizer, words: list[str]) -> None:
    shared = words[100:100 + MIN_LEN - 1]
    a = _text(tokenizer, words[0:5], shared, words[10:14])
    b = _text(tokenizer, words[20:23], shared, words[30:36])
    assert shared_spans([a, b], [0, 1], tokenizer, MIN_LEN) == [[], []]


def test_a_run_at_the_very_start_and_end_of_texts(tokenizer: TraceTokenizer, words: list[str]) -> None:
    shared = words[100:100 + MIN_LEN]
    a = _text(tokenizer, shared)
    b = _text(tokenizer, words[0:4], shared)
    c = _text(tokenizer, shared, words[50:53])
    spans = shared_spans([a, b, c], [0, 1, 2], tokenizer, MIN_LEN)
    assert _span_texts([a, b, c], spans) == [["".join(shared)]] * 3


def test_a_stretch_a_third_text_holds_in_part_is_cut_where_that_part_begins_and_ends(
        tokenizer: TraceTokenizer, words: list[str]) -> None:
    left, middle, right = words[100:110], words[110:120], words[120:130]
    a = _text(tokenizer, words[0:3], left, middle, right, words[3:6])
    b = _text(tokenizer, words[6:9], left, middle, right, words[9:12])
    c = _text(tokenizer, words[12:15], middle, words[15:18])
    spans = _span_texts([a, b, c], shared_spans([a, b, c], [0, 1, 2], tokenizer, MIN_LEN))
    pieces = ["".join(left), "".join(middle), "".join(right)]
    assert spans == [pieces, pieces, ["".join(middle)]]


def test_text_an_owner_repeats_alone_is_not_shared(tokenizer: TraceTokenizer, words: list[str]) -> None:
    shared = words[100:100 + 2 * MIN_LEN]
    a = _text(tokenizer, words[0:3], shared, words[3:6])
    b = _text(tokenizer, words[6:9], shared, words[9:12])
    other = _text(tokenizer, words[40:60])
    # the same owner's two texts: not shared; another owner's unrelated text changes nothing
    assert shared_spans([a, b, other], [0, 0, 1], tokenizer, MIN_LEN) == [[], [], []]


def test_two_stretches_in_one_text_at_other_positions_in_another(tokenizer: TraceTokenizer, words: list[str]) -> None:
    first, second = words[100:112], words[200:215]
    a = _text(tokenizer, words[0:3], first, words[3:6], second, words[6:8])
    b = _text(tokenizer, second, words[8:12], first)  # reversed order in b
    spans = _span_texts([a, b], shared_spans([a, b], [0, 1], tokenizer, MIN_LEN))
    assert spans == [["".join(first), "".join(second)], ["".join(second), "".join(first)]]
