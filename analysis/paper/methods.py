"""The paper's method names (as its tables print them) and its row order."""

from __future__ import annotations

METHOD_NAMES = {"NonShared": "nonshared", "FullShared": "fullshared", "DroidSpeak": "droidspeak",
                "CacheBlend": "cacheblend", "RelayCaching": "relaycaching", "KVComm": "kvcomm",
                "GraphFlow": "graphflow", "KVCMAS": "kvcmas"}
PAPER_NAMES = {name: paper for paper, name in METHOD_NAMES.items()} | {"kvcmas-nonchained": "KVCMAS non-chained"}


def method_order(method: str) -> int:
    """The paper's row order (NonShared first); methods it has not, after it."""
    order = list(METHOD_NAMES.values())
    return order.index(method) if method in order else len(order)


def paper_name(method: str) -> str:
    return PAPER_NAMES.get(method, method)
