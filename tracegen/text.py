"""Seeded, natural-looking shared context (documents and questions) with no downloads.

A small sentence grammar over a built-in word bank: varied enough that every trajectory's
context is different (dynamic context, as in the paper), cheap enough for 32K-token documents.
"""

from __future__ import annotations

import random

_NOUNS = (
    "engineer report market river city council budget museum farmer harvest bridge network "
    "library student teacher committee factory village railway company customer contract "
    "hospital doctor patient garden kitchen machine signal archive journal survey experiment "
    "laboratory sample measurement ocean island harbor ship captain storm forest valley mountain "
    "village school festival concert orchestra painter gallery novel chapter author reader "
    "ledger account invoice shipment warehouse truck driver route schedule station platform "
    "engine turbine reactor battery circuit sensor server cluster database query record table "
    "theory model equation variable result answer question method process system policy law "
    "court judge witness treaty province border election voter mayor minister agency program "
    "grant fund loan bank interest price cost profit revenue tax wage worker union strike"
).split()
_ADJECTIVES = (
    "careful large small ancient modern quiet busy remote local regional national private public "
    "early late rapid slow steady uneven detailed brief formal informal annual monthly weekly "
    "northern southern eastern western central coastal urban rural technical practical rough "
    "precise reliable uncertain expensive cheap narrow broad heavy light complex simple new old"
).split()
_VERBS = (
    "reviewed measured described approved rejected delayed improved reduced increased moved "
    "built repaired inspected recorded reported estimated compared replaced expanded closed "
    "opened funded studied questioned supported challenged organized analyzed collected shipped"
).split()
_ADVERBS = "quickly slowly carefully quietly openly rarely often briefly gradually suddenly".split()
_PREPOSITIONS = "near after before during across beyond within under over beside".split()
_NAMES = (
    "Adams Baker Chen Diaz Evans Fischer Garcia Hoffman Ivanova Jensen Kim Lopez Moreau Nakamura "
    "Okafor Patel Quinn Rossi Silva Tanaka Ueda Varga Wagner Xu Yilmaz Zhou"
).split()
_CONNECTIVES = ("However,", "Meanwhile,", "As a result,", "In addition,", "Later,", "By contrast,",
                "According to the survey,", "In the following year,")


def _sentence(rng: random.Random) -> str:
    pick = rng.choice
    pattern = rng.randrange(5)
    if pattern == 0:
        words = ["The", pick(_ADJECTIVES), pick(_NOUNS), pick(_VERBS), "the", pick(_NOUNS),
                 pick(_PREPOSITIONS), "the", pick(_ADJECTIVES), pick(_NOUNS) + "."]
    elif pattern == 1:
        words = [pick(_NAMES), pick(_ADVERBS), pick(_VERBS), "a", pick(_ADJECTIVES), pick(_NOUNS),
                 "worth", f"{rng.randrange(2, 9000):,}", "dollars."]
    elif pattern == 2:
        words = [pick(_CONNECTIVES), "the", pick(_NOUNS), "of", "the", pick(_NOUNS), "was",
                 pick(_VERBS), "by", f"{rng.randrange(2, 98)}", "percent."]
    elif pattern == 3:
        words = ["In", str(rng.randrange(1890, 2030)) + ",", "the", pick(_NOUNS), "council",
                 pick(_VERBS), "a", pick(_ADJECTIVES), "plan", "for", "the", pick(_NOUNS),
                 pick(_PREPOSITIONS), "the", pick(_NOUNS) + "."]
    else:
        words = ["Each", pick(_NOUNS), "near", "the", pick(_NOUNS), "had", str(rng.randrange(2, 500)),
                 pick(_NOUNS) + "s,", "and", pick(_NAMES), pick(_VERBS), "them", pick(_ADVERBS) + "."]
    return " ".join(words)


def document_words(rng: random.Random, approx_words: int, digits: bool = True) -> list[str]:
    """Words (each with its leading separator) of a document of paragraphs, about `approx_words` long.
    `digits` False: no sentence holds a number (a document that hides numbers a task asks for
    among none of its own, so a small model is not led astray by the filler)."""
    words: list[str] = []
    sentences_left_in_paragraph = rng.randrange(3, 8)
    while len(words) < approx_words:
        text = _sentence(rng)
        while not digits and any(c.isdigit() for c in text):
            text = _sentence(rng)
        sentence = text.split(" ")
        separator = "\n\n" if sentences_left_in_paragraph == 0 and words else " "
        if sentences_left_in_paragraph == 0:
            sentences_left_in_paragraph = rng.randrange(3, 8)
        sentences_left_in_paragraph -= 1
        words.append((separator if words else "") + sentence[0])
        words.extend(" " + w for w in sentence[1:])
    return words


def question(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    name = rng.choice(_NAMES)
    return (f"Question: based on the report above, how many {noun}s did {name} account for in total, "
            f"and which decision changed the outcome the most? Explain your reasoning.\n\nReport:\n")
