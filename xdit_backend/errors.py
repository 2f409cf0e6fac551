"""The base of every error a user can act on: what is wrong, and what to do instead."""


class UserError(Exception):
    """``message`` states the rule and the actual values; ``hint`` says how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message
