"""Files moved between a sweep's driver and its cluster workers, as bytes with their sha256:
an input (trace, model, adapter) is checked before a worker uses it, a finished run folder before
the driver commits it. Paths inside a bundle are relative (POSIX), never absolute."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class BundleError(RuntimeError):
    """A bundle's file does not hold what its digest says (or names a path outside its folder)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_files(folder: Path) -> list[Path]:
    """Every regular file under `folder`, sorted (links and sockets left out)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def folder_digests(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder`."""
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in folder_files(folder)}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder_files(folder))


@dataclass(frozen=True)
class FileBundle:
    """Files by relative path, and their digests."""

    files: dict[str, bytes]
    sha256: dict[str, str]

    @classmethod
    def of_folder(cls, folder: Path, under: str = "") -> FileBundle:
        """Every file under `folder`, named `under/<its path in folder>`."""
        files = {_join(under, p.relative_to(folder).as_posix()): p.read_bytes() for p in folder_files(folder)}
        return cls(files, {name: sha256_bytes(data) for name, data in files.items()})

    @classmethod
    def of_files(cls, paths: dict[str, Path]) -> FileBundle:
        files = {name: path.read_bytes() for name, path in paths.items()}
        return cls(files, {name: sha256_bytes(data) for name, data in files.items()})

    @property
    def total_bytes(self) -> int:
        return sum(len(data) for data in self.files.values())

    def verified(self) -> FileBundle:
        """This bundle, if every file matches its digest and stays inside its folder."""
        if set(self.files) != set(self.sha256):
            raise BundleError(f"files without digests or digests without files: {sorted(set(self.files) ^ set(self.sha256))}")
        for name, data in self.files.items():
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts or not path.parts:
                raise BundleError(f"{name!r} is not a path inside the bundle's folder")
            if sha256_bytes(data) != self.sha256[name]:
                raise BundleError(f"{name}: its bytes do not match their sha256 (damaged on the way)")
        return self

    def write_into(self, folder: Path) -> None:
        """Write every file under `folder` (checked first)."""
        self.verified()
        for name, data in self.files.items():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def under(self, prefix: str) -> FileBundle:
        """The files under `prefix/`, named relative to it."""
        start = prefix.rstrip("/") + "/"
        files = {name[len(start):]: data for name, data in self.files.items() if name.startswith(start)}
        return FileBundle(files, {name: self.sha256[start + name] for name in files})


def commit_folder(bundle: FileBundle, target: Path) -> None:
    """Replace `target` with the bundle's files, whole: they are written beside it first, then
    swapped in by renames, so a reader (or a crash) sees the old folder or the new one, not half
    (write_into checks the bundle before it writes anything)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    staging = target.with_name(f".{target.name}.incoming-{token}")
    bundle.write_into(staging)
    old = target.with_name(f".{target.name}.replaced-{token}")
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def place_folder(digests: dict[str, str], bundle: FileBundle | None, cache: Path, where: str) -> Path:
    """A folder holding exactly `digests`: `cache/<their digest>`, kept from an earlier task on
    this node or written from `bundle` (BundleError when neither is possible)."""
    key = sha256_bytes("\n".join(f"{name} {digest}" for name, digest in sorted(digests.items())).encode())[:24]
    folder = cache / key
    if folder.is_dir() and folder_digests(folder) == digests:
        return folder
    if bundle is None:
        raise BundleError(f"{where} is not on this node with the driver's files, and it was too large to send")
    if bundle.sha256 != digests:
        raise BundleError(f"{where}: the files sent are not the ones the driver listed")
    staging = cache / f".{key}.incoming-{uuid.uuid4().hex[:8]}"
    bundle.write_into(staging)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)
    return folder


def _join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}" if prefix else name
