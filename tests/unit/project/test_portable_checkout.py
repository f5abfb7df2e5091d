"""A fresh clone on another machine must install and pass: nothing tracked may point at the
folders of the machine that wrote it (a symlink, an absolute path). CI runs where those folders
exist, so only a check like this one sees it."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from paths import ROOT


def _tracked() -> list[tuple[str, str]]:
    """(mode, path) of every tracked file."""
    try:
        listing = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    entries = []
    for entry in listing.decode().split("\0"):
        if entry:
            meta, path = entry.split("\t", 1)
            entries.append((meta.split()[0], path))
    return entries


# folders every machine has, which a checkout may lie in without its siblings being this machine's
SHARED_PARENTS = {"/", "/tmp", "/var/tmp", "/home", "/Users", "/mnt", "/opt", "/srv", tempfile.gettempdir()}


def machine_paths() -> re.Pattern[str]:
    """Absolute paths that exist only on the machine running this: the checkout, the folder it
    lies in (its siblings: another venv, a results folder), the home folder, and any user's home."""
    folders = {str(ROOT), str(Path.home())}
    if str(ROOT.parent) not in SHARED_PARENTS:
        folders.add(str(ROOT.parent))
    mine = [re.escape(f.rstrip("/") + "/") for f in folders if f not in ("/", "")]
    return re.compile("|".join([*mine, r"/(?:home|Users)/[A-Za-z0-9_.-]+/"]))


def test_no_tracked_symlinks() -> None:
    links = [path for mode, path in _tracked() if mode == "120000"]
    assert links == [], f"tracked symlinks (a fresh clone gets a link to a folder it lacks): {links}"


def test_no_tracked_file_names_a_folder_of_this_machine() -> None:
    pattern = machine_paths()
    found = []
    for _mode, path in _tracked():
        file = ROOT / path
        if not file.is_file() or file.stat().st_size > 4 << 20:
            continue
        data = file.read_bytes()
        if b"\0" in data[:8192]:  # binary (weights, parquet): not read for paths
            continue
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if (match := pattern.search(line)) is not None:
                found.append(f"{path}:{number}: {match.group(0)}")
    assert found == [], "absolute paths of this machine in tracked files:\n" + "\n".join(found[:20])


def test_the_pattern_finds_what_it_is_for() -> None:
    pattern = machine_paths()
    assert pattern.search(f"model: {ROOT}/kvbench/model/weights/recall-v1")
    home, users = "/" + "home", "/" + "Users"  # not written whole: this file is scanned too
    assert pattern.search(f"{home}/alice/kvbench/results") and pattern.search(f"{users}/bob/x")
    assert not pattern.search("/usr/bin/chromium") and not pattern.search("/tmp/kvbench-x")
