"""KVComm as its public code runs it (FastMAS/KVCOMM), where `kvcomm` follows the KVCMAS paper's
description: a segment's context-free reference is prefilled after the prompt's own prefix (BOS,
so the segment's first token is no attention sink), an agent's output is corrected from its
producer's decode-phase cache instead of a reference, one segment the gate rejects sends the
whole agent to dense prefill, and a key correction is added where its anchor was observed, not
re-rotated to the target's positions (its deltas live in post-RoPE space). KVComm's correction
of the prompt-template text after each placeholder (PF deltas) is not reproduced:
docs/methods.md, "Faithfulness", says why."""

from __future__ import annotations

from kvbench.methods.kvcomm import KVComm
from kvbench.methods.specs.kvcomm_ref import SPEC


class KVCommRef(KVComm, spec=SPEC):
    reference_prefix = True
    outputs_from_producer = True
    whole_agent_fallback = True
    unrotated_deltas = True
