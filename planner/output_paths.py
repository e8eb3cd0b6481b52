"""Checks that a command's output paths can be written, before any work starts.

A command that fails on a bad output path after planning loses the work, and one that fails after
writing some of its outputs leaves them half-written; so `plan`, `sweep` and `report` check every
path they will write first. A file path is probed by creating it (and removing it again when it was
not there), a folder that is missing or will take files by creating and removing a folder in it:
what the file system refuses (`/proc`, a read-only mount, a directory's name) is found before
anything is computed, even by root, whom permission bits do not stop.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from planner.errors import invalid


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_file(path: str | Path, option: str) -> Path:
    """`path` as a Path when a file can be written there (missing folders are created later).

    Raises:
        PlannerError: INVALID_INPUT naming `option`: a directory, a folder that is a file, or a
            place the file system refuses.
    """
    path = Path(path)
    if path.is_dir():
        raise invalid(f"{option} {path}: is a directory; give a file path")
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        raise invalid(f"{option} {path}: {folder} is not a directory; give another path")
    if folder != path.parent:
        _probe(folder, path, option)
        return path
    existed = path.exists()
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    except OSError as error:
        raise invalid(f"{option} {path}: cannot be written ({error.strerror}); give another path") from None
    if not existed:
        path.unlink()
    return path


def check_writable_dir(path: str | Path, option: str) -> Path:
    """`path` as a Path when a folder is there or can be made there.

    Raises:
        PlannerError: INVALID_INPUT naming `option`: a file, or a place that cannot take a folder.
    """
    path = Path(path)
    folder = _nearest_existing(path)
    if not folder.is_dir():
        raise invalid(f"{option} {path}: {folder} is a file, not a directory; give a folder path")
    _probe(folder, path, option)
    return path


def _probe(folder: Path, path: Path, option: str) -> None:
    """Creates and removes a folder in `folder`, where `path`'s folders or files will go.

    Raises:
        PlannerError: INVALID_INPUT naming `option` when the file system refuses it.
    """
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".paraplan-probe-", dir=folder))
    except OSError as error:
        raise invalid(f"{option} {path}: {folder} cannot take new files ({error.strerror}); give another path") from None
