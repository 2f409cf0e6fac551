"""The base of every error a user can act on: what is wrong, and what to do instead."""

from __future__ import annotations


class UserError(Exception):
    """``message`` states the rule and the actual values; ``hint`` says how to fix it, in the command line's words
    (its flags); ``node_hint``, where the fix differs in ComfyUI, in the nodes' words (their widgets and actions),
    which the nodes show instead (the error's one source words itself for both callers)."""

    def __init__(self, message: str, hint: str = "", *, node_hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.node_hint = node_hint

    @classmethod
    def of(cls, exc: UserError):
        """``exc`` (a file's, a model's, a layout's) recast as this kind of error, its words for both callers kept."""
        return cls(exc.message, exc.hint, node_hint=exc.node_hint)

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class LaunchError(Exception):
    """The backend could not be started; the message names the rank and what it said."""


class UsageError(UserError, LaunchError):
    """A flag or file the user gave that cannot work, found before anything starts (the CLI exits 2 on it; a
    launcher's caller that catches LaunchError catches it too)."""


# A rank that loses a peer inside a collective exits with this code; the launcher then looks for
# the rank that failed first (launcher._root_cause). Here, not in control.py, so that the launcher
# (and through it the client) reads it without importing torch.distributed's side of the backend.
EXIT_PEER_LOST = 75
