"""Execution tokens: minted, checked with clear errors, stored 0600, never read from a file others can read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre import auth
from gyre.auth import TokenError, TokenFile


def test_minted_tokens_are_distinct_well_formed_and_prefixed() -> None:
    tokens = {auth.mint() for _ in range(100)}
    assert len(tokens) == 100
    for token in tokens:
        assert token.startswith(auth.EXECUTION_PREFIX) and auth.check(token) == token
    assert auth.mint(auth.RUN_PREFIX).startswith("gyre_run_")


@pytest.mark.parametrize(
    ("value", "words"),
    [("s3cr3t", r"too short \(6 characters"), ("with a space 0123456789", "printable ASCII"), (42, "must be a string")],
)
def test_malformed_tokens_say_what_is_wrong_without_echoing(value: object, words: str) -> None:
    with pytest.raises(TokenError, match=words) as info:
        auth.check(value)
    assert not isinstance(value, str) or value not in str(info.value)


@given(st.text(min_size=1, max_size=64))
def test_verify_accepts_exactly_the_token(other: str) -> None:
    token = auth.mint()
    assert auth.verify(token, auth.digest(token))
    assert auth.verify(other, auth.digest(token)) == (other == token)


def test_token_file_round_trip_is_private(tmp_path: Path) -> None:
    store = TokenFile(tmp_path / "sub" / "tokens.toml")
    a = store.add("exec-1")
    b = store.add("exec-2", "a-token-given-by-the-caller-0001")
    assert store.read() == {"exec-1": a, "exec-2": b}
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert [p.name for p in store.path.parent.iterdir()] == ["tokens.toml"]  # no temporary file left behind
    with pytest.raises(TokenError, match="already has a token"):
        store.add("exec-1")
    store.remove("exec-1")
    assert store.read() == {"exec-2": b}


def test_token_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    store = TokenFile(tmp_path / "tokens.toml")
    store.add("exec-1")
    os.chmod(store.path, 0o644)
    with pytest.raises(TokenError, match="chmod 600"):
        store.read()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[tokens]\nexec-1 = 'short'\n", "too short"),
        ("[tokens\n", "not valid TOML"),
        ("[other]\n", "one \\[tokens\\] table"),
        ('[tokens]\n"bad name" = "0123456789abcdef0"\n', "must match"),
    ],
)
def test_bad_token_files_are_clear_errors(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(TokenError, match=words):
        TokenFile(path).read()


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_TEST_SECRET", "  " + "s" * 20 + "\n")
    assert auth.from_env("GYRE_TEST_SECRET") == "s" * 20
    with pytest.raises(TokenError, match="GYRE_TEST_MISSING is not set"):
        auth.from_env("GYRE_TEST_MISSING")
