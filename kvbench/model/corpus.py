"""Training text present on every Python install: the standard library's own sources."""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
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


# Installed with kvbench (its dependencies and vLLM's): Python sources with docstrings, plus every
# installed distribution's description (READMEs: prose).
TRAINING_PACKAGES = ("click", "rich", "aiohttp", "jinja2", "yaml", "requests", "urllib3", "tqdm", "seaborn",
                     "fastapi", "starlette", "uvicorn", "_pytest", "pydantic", "networkx")
HELDOUT_EVERY = 20  # one file in 20, chosen by a hash of its path, is held out


STDLIB_PREFIX = "stdlib/"


def corpus_file_path(name: str) -> Path:
    """Where a corpus file name (relative to site-packages, or "stdlib/<module>.py") lives here."""
    if name.startswith(STDLIB_PREFIX):
        return Path(sysconfig.get_paths()["stdlib"]) / name[len(STDLIB_PREFIX):]
    return Path(sysconfig.get_paths()["purelib"]) / name


def read_corpus_files(names: Sequence[str]) -> list[str]:
    """The text of the named corpus files present on this machine."""
    paths = [corpus_file_path(name) for name in names]
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths if p.is_file()]


@dataclass(frozen=True)
class SplitCorpus:
    train: Corpus
    heldout_files: tuple[str, ...]  # corpus file names (corpus_file_path)


def package_corpus(packages: tuple[str, ...] = TRAINING_PACKAGES) -> SplitCorpus:
    """The standard library's top-level modules, the packages' sources and the installed
    distributions' descriptions; deduplicated by content; one file in HELDOUT_EVERY held out."""
    site = Path(sysconfig.get_paths()["purelib"])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths: list[tuple[str, Path]] = [(STDLIB_PREFIX + p.name, p) for p in sorted(stdlib.glob("*.py"))]
    for package in packages:
        paths += [(str(p.relative_to(site)), p) for p in sorted((site / package).rglob("*.py"))]
    paths += [(str(p.relative_to(site)), p) for p in sorted(site.glob("*.dist-info/METADATA"))]
    seen: set[str] = set()
    documents, files, heldout = [], [], []
    digest = hashlib.sha256()
    for name, path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        content = hashlib.sha256(text.encode()).hexdigest()
        if content in seen or len(text) < 200:
            continue
        seen.add(content)
        if int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0:
            heldout.append(name)
            continue
        documents.append(text)
        files.append(name)
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    if not documents:
        raise RuntimeError(f"no training text found under {site}")
    return SplitCorpus(Corpus(tuple(documents), tuple(files), digest.hexdigest()), tuple(heldout))
