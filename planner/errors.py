"""The one error type the planner raises for anything a user can fix."""
from __future__ import annotations

from enum import StrEnum


class PlannerErrorKind(StrEnum):
    INVALID_INPUT = "invalid_input"
    UNSUPPORTED_MODEL = "unsupported_model"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    SOLVER_LIMIT = "solver_limit"


EXIT_CODES = {
    PlannerErrorKind.INVALID_INPUT: 2,
    PlannerErrorKind.UNSUPPORTED_MODEL: 2,
    PlannerErrorKind.INSUFFICIENT_MEMORY: 3,
    PlannerErrorKind.SOLVER_LIMIT: 3,
}


class PlannerError(Exception):
    """A problem with the user's input or the search, with a one-line message that names the fix.

    Args:
        kind: what went wrong, which also decides the CLI exit code.
        message: one line naming the field at fault and what would fix it.
    """

    def __init__(self, kind: PlannerErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __reduce__(self):
        """Pickled with its kind and message (a sweep's worker processes send errors back)."""
        return type(self), (self.kind, self.message)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]


def invalid(message: str) -> PlannerError:
    return PlannerError(PlannerErrorKind.INVALID_INPUT, message)


def unsupported(message: str) -> PlannerError:
    return PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, message)


def check_positive_int(name: str, value) -> None:
    """PlannerError naming `name` unless `value` is a positive int (bools and numeric text are not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{name}={value!r}: must be a positive integer")
