"""User-facing errors.

Everything a user can get wrong (a bad id, a missing file, a malformed config) raises
`EngramflowError` with a message that names the offending value. The CLI turns it into a
one-line message on stderr and exit status 2.
"""


class EngramflowError(ValueError):
    """Bad input or bad data: the message says which value and why."""


SEED_MAX = 2**32 - 1  # every seed (sampling, synthetic checkpoints) is an integer in [0, SEED_MAX]


def check_seed(seed, what: str = "seed") -> int:
    """`seed` if it is an integer in [0, SEED_MAX], else an EngramflowError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise EngramflowError(f"{what} must be an integer in [0, {SEED_MAX}], got {seed!r}")
    return seed
