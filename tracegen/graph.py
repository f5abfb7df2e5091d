"""Turn dependency graphs, walked iteratively: a trace may chain thousands of turns, deeper than
Python's recursion limit, listed in any order."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence


def topological_order(after: Mapping[str, Sequence[str]]) -> list[str] | None:
    """Turn ids with every turn after all the turns it waits for; None when the `after` edges
    hold a cycle. Edges to unknown turns are ignored (reported elsewhere)."""
    order = _placeable(after)
    return order if len(order) == len(after) else None


def _placeable(after: Mapping[str, Sequence[str]]) -> list[str]:
    """Kahn's algorithm: the turns that can be ordered, in order; the others wait (transitively)
    on a cycle."""
    waiting_on = {node: sum(1 for dep in deps if dep in after) for node, deps in after.items()}
    dependents: dict[str, list[str]] = {node: [] for node in after}
    for node, deps in after.items():
        for dep in deps:
            if dep in after:
                dependents[dep].append(node)
    ready = deque(node for node, count in waiting_on.items() if count == 0)
    order: list[str] = []
    while ready:
        node = ready.popleft()
        order.append(node)
        for dependent in dependents[node]:
            waiting_on[dependent] -= 1
            if waiting_on[dependent] == 0:
                ready.append(dependent)
    return order


def find_cycle(after: Mapping[str, Sequence[str]]) -> list[str]:
    """One dependency cycle, as a path that ends where it starts (empty when there is none)."""
    placed = set(_placeable(after))
    if len(placed) == len(after):
        return []
    start = next(node for node in after if node not in placed)
    path, seen = [start], {start: 0}
    node = start
    while True:  # follow unplaced dependencies until one repeats: that stretch is a cycle
        node = next(dep for dep in after[node] if dep in after and dep not in placed)
        if node in seen:
            return path[seen[node]:] + [node]
        seen[node] = len(path)
        path.append(node)


def ancestor_masks(order: Sequence[str], after: Mapping[str, Sequence[str]],
                   index: Mapping[str, int]) -> dict[str, int]:
    """Every turn's transitive `after` closure as a bit set over `index` (ints: a 5,000-turn chain
    takes a few MB, where sets of ids would take hundreds). `order` must be topological."""
    masks: dict[str, int] = {}
    for node in order:
        mask = 0
        for dep in after[node]:
            if dep in masks:  # unknown turns are reported elsewhere
                mask |= masks[dep] | (1 << index[dep])
        masks[node] = mask
    return masks


def bits_descending(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, highest first."""
    while mask:
        top = mask.bit_length() - 1
        yield top
        mask ^= 1 << top
