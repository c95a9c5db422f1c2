"""Run secrets and execution tokens: minted, checked, hashed, stored — transport-agnostic.

A harness proves which execution it is by a bearer token (the proxy's API key); cluster components prove
they belong to a run by the run secret. Both are the same kind of value, handled here once:

- `mint(kind)` makes one (256 bits from `secrets`, with a readable prefix so a leaked value is recognisable).
- `check(token)` rejects a malformed value with an error that says what is wrong (never a traceback).
- `digest(token)` is what servers keep and look up: a SHA-256, so a table of digests leaks no token and a
  dictionary lookup by digest says nothing about how much of a guessed token was right; `verify` compares in
  constant time where a single expected digest is known.
- `TokenFile` stores tokens by name in a file only its owner can read (0600), never on a command line
  (argv is visible to every user through `ps`). `from_env` reads one from an environment variable.
"""

from gyre.auth.tokens import (
    EXECUTION_PREFIX,
    MIN_TOKEN_CHARS,
    RUN_PREFIX,
    TokenError,
    TokenFile,
    check,
    digest,
    from_env,
    mint,
    verify,
)

__all__ = [
    "EXECUTION_PREFIX",
    "MIN_TOKEN_CHARS",
    "RUN_PREFIX",
    "TokenError",
    "TokenFile",
    "check",
    "digest",
    "from_env",
    "mint",
    "verify",
]
