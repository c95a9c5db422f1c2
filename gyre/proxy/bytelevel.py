"""GPT-2 byte-level alphabet: token strings back to raw bytes (for OpenAI's `logprobs[].bytes`)."""

from functools import lru_cache


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def byte_level_bytes(piece: str) -> bytes:
    """Bytes of a byte-level token string; added tokens (not in the alphabet) are their UTF-8."""
    table = _unicode_to_byte()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode()
