"""`gyre.transfer`: point-to-point byte movement between processes with the Mooncake Transfer Engine.

One small typed wrapper serves every bulk move in Gyre: KV pages engine -> engine when a call is
redirected; weights core -> satellites and engines, and gradients satellites -> core (`gyre.transfer.tensors`:
flat manifests, the publisher, pulls, gradient slots). Callers register the memory they expose, describe
remote memory as `Span`s, and move bytes with one batched call.
"""

from gyre.errors import TransferError
from gyre.transfer.endpoint import EndpointConfig, Region, Span, TransferEndpoint, TransferStats, merge_spans

__all__ = ["EndpointConfig", "Region", "Span", "TransferEndpoint", "TransferError", "TransferStats", "merge_spans"]
