"""The native client (deepx_core/client.py) under the SDK's name: `from deepx_sdk.client import NativeClient`."""

from deepx_core.client import PROTOCOL_VERSION, DeepxTimeoutError, NativeClient, RunReply, check_peer, decode_tensor

__all__ = ["PROTOCOL_VERSION", "DeepxTimeoutError", "NativeClient", "RunReply", "check_peer", "decode_tensor"]
