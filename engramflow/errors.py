"""User-facing errors.

Everything a user can get wrong (a bad id, a missing file, a malformed config) raises
`EngramflowError` with a message that names the offending value. The CLI turns it into a
one-line message on stderr and exit status 2.
"""


class EngramflowError(ValueError):
    """Bad input or bad data: the message says which value and why."""
