"""Measurement protocols of a replay: what each turn's prompt carries and how far each request runs.

- free: each turn reads this run's own upstream outputs and decodes its whole output length: what
  a deployment sees, decode load included.
- paper: the KVCMAS paper's serving protocol (its Appendix B.4): every prompt carries a reference
  run's outputs (a free NonShared replay of the same trace: token-identical prompts whatever the
  method does) and every request stops at its first generated token (`max_tokens` 1). TTFT is
  then measured without the decode load the free protocol adds.
- paper-decode: the single-stream protocol of its Appendix C.1: the reference's outputs in every
  prompt, each turn decoding its whole output (throughput counts those tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Protocol:
    name: str
    anchored: bool  # prompts carry the reference run's outputs
    first_token_only: bool  # each request stops at its first generated token
    caption: str


PROTOCOLS = {p.name: p for p in [
    Protocol("free", False, False,
             "free-running: each agent decodes its whole output and the next agents read it (decode load included, "
             "which the paper's serving measurements do not have)"),
    Protocol("paper", True, True,
             "the paper's (Appendix B.4): every prompt carries the NonShared reference run's outputs and every request "
             "stops at its first generated token"),
    Protocol("paper-decode", True, False,
             "the paper's single-stream protocol (Appendix C.1): every prompt carries the NonShared reference run's "
             "outputs and every turn decodes its whole output (throughput counts those tokens)"),
]}


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]
