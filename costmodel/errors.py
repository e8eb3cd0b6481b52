"""Errors raised by the cost model for bad hardware input (profiles, cluster files, shorthands)."""
from __future__ import annotations


class ProfileError(ValueError):
    """A hardware profile or cluster description is wrong; the message is one line naming the file, field and fix."""
