"""GPT-2 byte-level alphabet: token strings back to raw bytes (for OpenAI's `logprobs[].bytes`)."""

from functools import lru_cache

from gyre.model.tokenizer import bytes_to_unicode


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def byte_level_bytes(piece: str) -> bytes:
    """Bytes of a byte-level token string; added tokens (not in the alphabet) are their UTF-8."""
    table = _unicode_to_byte()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode()
