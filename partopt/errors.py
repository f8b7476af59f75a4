"""Errors a user can cause: each carries a one-line cause, where it happened and what to do."""

from __future__ import annotations


def first_line(err: BaseException) -> str:
    """The first line of a third-party exception's message (its type's name when it has none): what a one-line
    error can quote of it."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def short(value: object, limit: int = 40) -> str:
    """`repr(value)`, cut to `limit` characters (a 400-digit number stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


class PartoptError(Exception):
    """Base of every error the CLI reports without a traceback (exit code 2).

    `where` names the place (file, JSON path, op or tensor name); `hint` says what to do.
    """

    def __init__(self, cause: str, where: str | None = None, hint: str | None = None):
        self.cause = cause
        self.where = where
        self.hint = hint
        super().__init__(self.line())

    def line(self) -> str:
        """The single line the CLI prints."""
        text = f"{self.where}: {self.cause}" if self.where else self.cause
        return f"{text} (hint: {self.hint})" if self.hint else text

    def located(self, prefix: str) -> "PartoptError":
        """The same error with `prefix` (usually a file name) put before its place."""
        where = f"{prefix}: {self.where}" if self.where else prefix
        return type(self)(self.cause, where, self.hint)


class InstanceError(PartoptError):
    """A graph, cluster or plan file (or object) that is malformed or inconsistent."""


class InfeasibleError(PartoptError):
    """A request that no plan can satisfy (memory, divisibility, cluster size)."""


class SolverError(PartoptError):
    """A solver that failed or ran out of time without a solution."""
