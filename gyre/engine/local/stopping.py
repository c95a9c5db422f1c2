"""When a request is done: stop tokens, stop strings, length - checked after every sampled token."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.engine.protocol import FinishReason, SamplingParams

Decode = Callable[[Sequence[int]], str]


class StopChecker:
    """Finish rule of one request. Order: stop token, then stop string, then `max_new_tokens`.

    Stop strings are searched in the decoded tail of the output only (a window a few tokens longer than
    the longest stop string in bytes), so the check costs O(1) per token however long the output grows.
    Special tokens are decoded as text here, so `"<|im_end|>"` works as a stop string too.
    """

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], decode: Decode) -> None:
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= eos_ids
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = params.stop_strings
        self.max_new_tokens = params.max_new_tokens
        self._decode = decode
        # Every token decodes to at least one byte, so this many tokens always cover a whole match.
        self._window = max((len(s.encode("utf-8")) for s in self.stop_strings), default=0) + 4

    def check(self, output_ids: Sequence[int]) -> FinishReason | None:
        last = output_ids[-1]
        if last in self.stop_ids:
            return FinishReason(type="stop", matched=last)
        if self.stop_strings:
            tail = self._decode(output_ids[-self._window :])
            for s in self.stop_strings:
                if s in tail:
                    return FinishReason(type="stop", matched=s)
        if len(output_ids) >= self.max_new_tokens:
            return FinishReason(type="length", length=self.max_new_tokens)
        return None


def visible_text(
    output_ids: Sequence[int], finish: FinishReason | None, params: SamplingParams, decode_text: Decode
) -> str:
    """The response `text`: output decoded, with the matched stop token/string (and anything after the
    string) trimmed unless `no_stop_trim` - SGLang's behaviour. `output_ids` are never trimmed."""
    ids = list(output_ids)
    trim_str = None
    if finish is not None and finish.type == "stop" and not params.no_stop_trim:
        if isinstance(finish.matched, int) and ids and ids[-1] == finish.matched:
            ids = ids[:-1]
        elif isinstance(finish.matched, str):
            trim_str = finish.matched
    text = decode_text(ids)
    if trim_str is not None and trim_str in text:
        text = text[: text.index(trim_str)]
    return text
