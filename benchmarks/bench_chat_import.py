"""Benchmark: `kvbench trace import --format openai-chat` on synthetic agent logs of 100, 300 and
1,000 requests (issue 49's target: a 300-request log in under a minute).

The log is one session of four agents taking turns (planner, researcher, coder, critic): every
request carries the session's task document (--doc-tokens of report text), a tool output shared
by the five requests after it was fetched, the three latest responses quoted (its parents), and
an instruction of its own; each response is new text of about 100 tokens. Timed: reading the
log, the import (span search included) and the token-for-token prompt check, as the command runs
them; printed per size with the shared segments found.

    .venv/bin/python benchmarks/bench_chat_import.py [--requests 100,300,1000] [--doc-tokens 1500]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path

from kvbench.replay.import_check import prompt_mismatches
from kvbench.tracegen.chat_import import chat_log_trace, describe
from kvbench.tracegen.chat_log import read_chat_log
from kvbench.tracegen.generate import TokenCounter, document_words, shared_context
from kvbench.tracegen.tokenizer import TraceTokenizer, load_tokenizer

AGENTS = ("planner", "researcher", "coder", "critic")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(document_words(rng, count)).strip()


def synthetic_log(requests: int, doc_tokens: int, tokenizer: TraceTokenizer, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    document = shared_context(TokenCounter(tokenizer), rng, doc_tokens)
    rows: list[dict] = []
    tool_output = ""
    for k in range(requests):
        agent = AGENTS[k % len(AGENTS)]
        if k % 5 == 0:
            tool_output = f"Tool output (search #{k // 5}):\n" + _words(rng, 300)
        quoted = rows[-3:]
        user = (f"Task document:\n{document}\n\n{tool_output}\n\n"
                + "".join(f"Finding of {r['agent']}:\n{r['response']}\n\n" for r in quoted)
                + f"Step {k}: {_words(rng, 20)}")
        rows.append({"id": f"r{k}", "agent": agent, "timestamp": 0.5 * k, "parent_ids": [r["id"] for r in quoted],
                     "messages": [{"role": "system", "content": f"You are the {agent} of a research team. "
                                                                 "Answer briefly and precisely."},
                                  {"role": "user", "content": user}],
                     "response": _words(rng, 100)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", default="100,300,1000")
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--min-span-tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)  # loaded once, outside the timed region, as the CLI does
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"model kvbench:recall-v1 (its tokenizer), commit {commit}, {platform.node()} ({platform.machine()})")
    for size in (int(n) for n in args.requests.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "log.jsonl"
            log.write_text("".join(json.dumps(r) + "\n" for r in synthetic_log(size, args.doc_tokens, tokenizer)))
            started = time.perf_counter()
            records = read_chat_log(log)
            read_s = time.perf_counter() - started
            started = time.perf_counter()
            _, trajectories = chat_log_trace(records, tokenizer, args.min_span_tokens)
            import_s = time.perf_counter() - started
            started = time.perf_counter()
            mismatches = prompt_mismatches(records, trajectories, tokenizer)
            check_s = time.perf_counter() - started
        found = describe(trajectories)
        tokens = sum(len(tokenizer.encode(m["content"])) for r in records for m in
                     [{"content": text} for _, text in r.messages])
        print(f"requests={size} log_tokens={tokens:,} read_s={read_s:.2f} import_s={import_s:.2f} "
              f"check_s={check_s:.2f} total_s={read_s + import_s + check_s:.2f} "
              f"shared_segments={found['shared_segments']} shared_tokens={found['shared_tokens']:,} "
              f"output_reuses={found['output_reuses']} prompt_mismatches={len(mismatches)}", flush=True)


if __name__ == "__main__":
    main()
