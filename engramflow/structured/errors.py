"""The one error of this package: what a request asked for cannot be enforced (a 400)."""
from engramflow.errors import EngramflowError


class GrammarError(EngramflowError):
    """A grammar the request gave does not compile, or uses what is not enforced."""
