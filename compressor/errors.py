"""Errors a user can fix. The CLI prints these as one line, without a traceback."""


class UserError(Exception):
    """A problem with the user's input: the message names the problem and the fix, on one line."""


class CheckpointError(UserError):
    """A compressed checkpoint that is missing, truncated, edited or from a newer tool version."""


class NumericalError(RuntimeError):
    """A numerical failure (non-finite values, an SVD that did not converge) that we refuse to hide."""
