"""Minting, checking, hashing and storing bearer tokens (see the package docstring for the rules)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

from gyre.errors import GyreError

EXECUTION_PREFIX = "gyre_ex_"
RUN_PREFIX = "gyre_run_"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512
_TOKEN_CHARS = re.compile(r"[!-~]+")  # printable ASCII without space: what fits in an HTTP header as is
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


class TokenError(GyreError, ValueError):
    """A token or token file is malformed, unreadable or unsafe; the message says which and how to fix it."""


def mint(prefix: str = EXECUTION_PREFIX) -> str:
    """A new token: `prefix` + 43 URL-safe characters (256 random bits)."""
    return prefix + secrets.token_urlsafe(32)


def check(token: object, what: str = "execution token") -> str:
    """`token` if it is well formed, else a `TokenError` naming the problem (the token itself is never echoed)."""
    if not isinstance(token, str):
        raise TokenError(f"{what} must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"{what} is too short ({len(token)} characters; at least {MIN_TOKEN_CHARS}): "
            "mint one with `gyre proxy token`"
        )
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenError(f"{what} is too long ({len(token)} characters; at most {MAX_TOKEN_CHARS})")
    if not _TOKEN_CHARS.fullmatch(token):
        raise TokenError(f"{what} may contain only printable ASCII characters without spaces")
    return token


def digest(token: str) -> bytes:
    """What a server keeps instead of the token."""
    return hashlib.sha256(token.encode()).digest()


def verify(token: str, expected_digest: bytes) -> bool:
    """Whether `token` hashes to `expected_digest`, compared in constant time."""
    return hmac.compare_digest(digest(token), expected_digest)


def from_env(variable: str, what: str = "token", environ: Mapping[str, str] | None = None) -> str:
    """The token in environment variable `variable`, checked."""
    env = os.environ if environ is None else environ
    value = env.get(variable)
    if value is None:
        raise TokenError(f"environment variable {variable} is not set; it should hold the {what}")
    return check(value.strip(), f"{what} in ${variable}")


class TokenFile:
    """Named tokens in a TOML file readable by its owner only: `[tokens]` table, `name = "token"`.

    Reading refuses a file that group or others may read (as ssh does for private keys): a token that leaked
    must be assumed used. Writing replaces the file atomically (temporary file, fsync, rename), created 0600.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, str]:
        """All tokens by name; a missing file is an empty one."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return {}
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"token file {self.path} is not a regular file")
        if info.st_mode & 0o077:
            raise TokenError(
                f"token file {self.path} is readable by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"run `chmod 600 {self.path}`"
            )
        try:
            data = tomllib.loads(self.path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TokenError(f"token file {self.path} is not valid TOML: {e}") from e
        table = data.get("tokens", {})
        unknown = sorted(set(data) - {"tokens"})
        if unknown or not isinstance(table, dict):
            raise TokenError(f'token file {self.path} must hold one [tokens] table of name = "token" entries')
        tokens: dict[str, str] = {}
        for name, token in table.items():
            tokens[check_name(name)] = check(token, f"token of {name!r} in {self.path}")
        return tokens

    def add(self, name: str, token: str | None = None, *, prefix: str = EXECUTION_PREFIX) -> str:
        """Store a token (minted when None) under `name`, which must be new; returns the token."""
        check_name(name)
        tokens = self.read()
        if name in tokens:
            raise TokenError(f"{name!r} already has a token in {self.path}; remove it first to mint another")
        token = check(token) if token is not None else mint(prefix)
        tokens[name] = token
        self.write(tokens)
        return token

    def remove(self, name: str) -> None:
        tokens = self.read()
        if tokens.pop(name, None) is None:
            raise TokenError(f"{name!r} has no token in {self.path}")
        self.write(tokens)

    def write(self, tokens: Mapping[str, str]) -> None:
        lines = ["# Gyre tokens: secrets, keep this file private (mode 0600).", "[tokens]"]
        lines += [f"{json.dumps(check_name(n))} = {json.dumps(check(t))}" for n, t in tokens.items()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.read().items())


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TokenError(f"token name {name!r} must match [A-Za-z0-9][A-Za-z0-9._:-]* (an execution id)")
    return name
