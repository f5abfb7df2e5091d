"""Training text present on every Python install: the standard library's own sources."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Corpus:
    documents: tuple[str, ...]
    files: tuple[str, ...]
    sha256: str

    @property
    def num_bytes(self) -> int:
        return sum(len(d.encode()) for d in self.documents)


def stdlib_corpus() -> Corpus:
    """The top-level modules of the running interpreter's standard library, in sorted order.

    Top-level files only: they exist on every CPython build (test suites and vendored packages
    are often stripped by distributions), and 4-5 MB is plenty for a 4M-parameter model.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.glob("*.py") if p.is_file())
    if not paths:
        raise RuntimeError(f"no standard-library sources found under {root}")
    documents = []
    digest = hashlib.sha256()
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        documents.append(text)
        digest.update(path.name.encode() + b"\0" + text.encode() + b"\0")
    return Corpus(tuple(documents), tuple(p.name for p in paths), digest.hexdigest())
