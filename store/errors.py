"""Errors a user can cause (bad path, bad file, wrong permissions).

The CLI prints them as one line naming the file and what to do, and exits non-zero; a
traceback is kept for our own bugs.
"""


class UserError(Exception):
    """Base of every error whose message is meant for the operator, not a developer."""

    exit_code = 1
