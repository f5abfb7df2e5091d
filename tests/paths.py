"""Where the tests' files are, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the checkout
DATA = TESTS / "data"
HELPERS = TESTS / "helpers"
