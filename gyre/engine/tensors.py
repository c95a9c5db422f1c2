"""Named tensors on the wire for `/update_weights_from_tensor`: base64 of a safetensors blob.

safetensors rather than SGLang's pickled tensor handles: it is portable across hosts and safe to load
from the network (a pickle is code). torch and safetensors are imported lazily so `gyre.engine`'s
client stays importable without them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from gyre.engine.errors import EngineRequestError

if TYPE_CHECKING:
    import torch

NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


def encode_named_tensors(named_tensors: NamedTensors) -> str:
    """One `serialized_named_tensors` entry (tensors are moved to CPU and made contiguous)."""
    from safetensors.torch import save

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    blob = save({name: t.detach().contiguous().cpu() for name, t in items})
    return base64.b64encode(blob).decode("ascii")


def decode_named_tensors(entries: list[str]) -> dict[str, torch.Tensor]:
    """Merge `serialized_named_tensors` entries; a bad entry is an `EngineRequestError` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    tensors: dict[str, torch.Tensor] = {}
    for i, entry in enumerate(entries):
        field = f"serialized_named_tensors.{i}"
        try:
            blob = base64.b64decode(entry, validate=True)
        except ValueError as e:  # binascii.Error, and a ValueError for non-ASCII text (found by fuzzing)
            raise EngineRequestError(field, f"not valid base64: {e}") from e
        try:
            tensors.update(load(blob))
        except SafetensorError as e:
            raise EngineRequestError(field, f"not a safetensors blob: {e}") from e
    return tensors
