"""Rows a method asked for, handed over once the request's prompt is computed.

A method observes rows after they are computed (a dense segment becomes an anchor): rows the
connector computed are final when its load ends, rows vLLM prefilled after the claim only after
the forward of the step that finishes the prompt, when the scheduler side names the request and
its blocks (KVBenchMetadata.prefilled). Then, in that step's wait_for_save, the blocks are still
the request's own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

logger = logging.getLogger("kvbench.connector")

RowsDelivery = Callable[[torch.Tensor, torch.Tensor], None]  # (K, V) [layers, rows, Hkv, hd]
RowsReader = Callable[[torch.Tensor], Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]


class RowDeliveries:
    def __init__(self) -> None:
        self._readers: dict[str, list[tuple[torch.Tensor, RowsDelivery]]] = {}
        self._keys: dict[str, str] = {}  # request -> its stats key, where the delivery time goes

    def ask(self, req_id: str, rows: torch.Tensor, deliver: RowsDelivery, key: str | None = None) -> None:
        self._readers.setdefault(req_id, []).append((rows, deliver))
        if key is not None:
            self._keys[req_id] = key

    def deliver(self, prefilled: dict[str, list[int]], reader: RowsReader, stats: dict[str, Any]) -> None:
        """After the forward: the rows of requests whose prompt it finished (`reader`: block ids ->
        a reader of rows), to those waiting for them; the time it took in the request's stats."""
        for req_id, block_ids in prefilled.items():
            readers = self._readers.pop(req_id, None)
            key = self._keys.pop(req_id, req_id)
            if not readers:
                continue
            started = time.perf_counter()
            try:
                with torch.inference_mode():  # each layer read once, up to the last row anyone asked for
                    k, v = reader(torch.tensor(block_ids, dtype=torch.long))(torch.cat([rows for rows, _ in readers]))
            except Exception:  # the method then misses these observations, nothing more
                logger.exception("kvbench: reading the rows of %s failed", req_id)
                continue
            offset = 0
            for rows, deliver in readers:
                try:
                    deliver(k[:, offset:offset + len(rows)], v[:, offset:offset + len(rows)])
                except Exception:
                    logger.exception("kvbench: delivering rows of %s failed", req_id)
                offset += len(rows)
            # inside the step that computes the request's first token: part of its TTFT
            stats.setdefault(key, {})["rows_delivery_s"] = time.perf_counter() - started

    def drop(self, req_ids: Iterable[str]) -> None:
        """Requests that ended (aborted before their prompt was computed, or never loaded)."""
        for req_id in req_ids:
            self._readers.pop(req_id, None)
            self._keys.pop(req_id, None)

    def clear(self) -> None:
        self._readers.clear()
        self._keys.clear()
