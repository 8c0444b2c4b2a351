"""Every document a tracked file cites is in the repository: nothing points at the machines' shared notes.

The team's machine notes live outside the repository, in a folder beside it; what the code relies on from them is
copied into ``docs/environment.md``, which a fresh clone has. ``docs/history`` keeps old write-ups as written.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Built from parts so that this file does not cite what it forbids.
OUTSIDE = re.compile(rb"\.\./" + rb"shared/|" + rb"ENVIRON" + rb"MENT\.md")


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
    return [ROOT / name for name in listing.decode().split("\0") if name]


def test_no_tracked_file_cites_a_document_outside_the_repository():
    files = [path for path in _tracked_files()
             if path.is_file() and not path.relative_to(ROOT).as_posix().startswith("docs/history/")]
    assert len(files) > 100  # the listing worked
    citing = sorted(path.relative_to(ROOT).as_posix() for path in files if OUTSIDE.search(path.read_bytes()))
    assert citing == [], f"cite docs/environment.md instead of the shared notes in: {citing}"
