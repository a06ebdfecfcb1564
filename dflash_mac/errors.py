"""User errors: every front end catches `UserError` and shows its message as one sentence.

Anything the user can fix (a bad flag, a missing folder, a pair that does not fit, a prompt
over the context) raises a subclass; everything else is a bug and keeps its traceback."""

from __future__ import annotations

from .models.config import ConfigError

INTERRUPTED = "interrupted."  # what Ctrl-C prints, at start-up or while a command runs


class UserError(Exception):
    """A problem the user can fix; the message is one sentence for them."""


class LoadError(UserError, RuntimeError):
    """A pair that cannot be resolved, validated or loaded."""


class PromptError(UserError, ValueError):
    """A prompt or template option that cannot be used."""


class RollbackError(UserError, RuntimeError):
    """The target's cache cannot be rolled back (an unsupported cache type)."""


def is_user_error(e: BaseException) -> bool:
    """True for the exceptions every front end shows as one sentence: `UserError`, and a
    drafter config error from models/ (which cannot know this base class)."""
    return isinstance(e, (UserError, ConfigError))
