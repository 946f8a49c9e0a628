"""Weight transports: how one refit bucket travels from the caller to the engine's workers (one file each)."""

from mrl.inference.transports.base import WeightTransport, make_transport, unpack_payload

__all__ = ["WeightTransport", "make_transport", "unpack_payload"]
