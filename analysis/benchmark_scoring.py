"""Reading the final answer of a benchmark workload (`gen-trace --task mmlu|gsm8k|humaneval`).

- GSM8K: the number after the last "The answer is" (the format FinalRefer is asked for); where
  there is none, the last number of the output (the usual fallback of GSM8K harnesses). Compared
  as numbers: "1,250", "1250.0" and "$1250" are the same answer.
- MMLU: the letter of the last line of the form "Answer: X" (X one of A-D, optionally in
  parentheses or bold, a period after it). Anything else is unparseable, and counted, never
  guessed from a letter somewhere in the text.
- HumanEval: the last fenced code block of the output (the whole output without one). Code that
  defines the entry point replaces the prompt's stub; other code continues the prompt's body, as
  HumanEval completions do. Run with the item's tests by analysis/code_execution.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvbench.tracegen.benchmark_workloads import GSM8K_ANSWER_MARKER, MMLU_ANSWER_MARKER

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"
_GSM8K_MARKED = re.compile(re.escape(GSM8K_ANSWER_MARKER) + r"[:\s]*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_MMLU_LINE = re.compile(r"^\s*\**\s*" + re.escape(MMLU_ANSWER_MARKER) + r"\s*\**\s*\(?([ABCD])\)?\s*\**\s*\.?\s*\**\s*$")
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedAnswer:
    answer: str | None  # None: unparseable
    how: str  # "marker", "last number", "answer line", "code block", "raw", "none"


def _number(text: str) -> str:
    return text.replace("$", "").replace(",", "").rstrip(".")


def gsm8k_answer(output: str) -> ParsedAnswer:
    marked = _GSM8K_MARKED.findall(output)
    if marked:
        return ParsedAnswer(_number(marked[-1]), "marker")
    numbers = _ANY_NUMBER.findall(output)
    return ParsedAnswer(_number(numbers[-1]), "last number") if numbers else ParsedAnswer(None, "none")


def same_number(answer: str | None, gold: str) -> bool:
    if answer is None:
        return False
    try:
        return math.isclose(float(answer), float(_number(gold)), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return False


def mmlu_answer(output: str) -> ParsedAnswer:
    for line in reversed(output.splitlines()):
        match = _MMLU_LINE.match(line)
        if match:
            return ParsedAnswer(match.group(1), "answer line")
    return ParsedAnswer(None, "none")


def humaneval_completion(output: str, entry_point: str) -> ParsedAnswer:
    """What is appended to the problem's prompt before its tests run."""
    blocks = _CODE_BLOCK.findall(output)
    code, how = (blocks[-1], "code block") if blocks else (output, "raw")
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return ParsedAnswer("\n" + code, how)  # a whole function: it replaces the prompt's stub
    return ParsedAnswer(code, how)
