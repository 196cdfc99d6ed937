"""Errors a user can act on. Each carries the fix, so the CLI can print one clear line."""


class TreegraftError(Exception):
    """A user-facing error: ``message`` says what is wrong, ``hint`` says how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ConfigError(TreegraftError):
    """A setting is out of range or inconsistent (budget < 1, depth < 1, unknown method ...)."""


class ModelError(TreegraftError):
    """A model cannot be resolved, fetched, verified or loaded."""
