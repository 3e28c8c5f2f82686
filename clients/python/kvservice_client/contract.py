"""What the service and its clients must agree on besides the messages (``kvservice_client.proto``):
the metadata keys a call carries, the channel options both ends set, how a local engine proves
its uid (the credential socket), the token files both ends read, and the dtypes a page holds.

The service imports these from here, never from the SDK's private modules, so a change to one
of them is a change to a public contract (and its tests), not an internal refactor.
"""

from __future__ import annotations

from ._client import channel_options, message_size_options
from ._keepalive import DEFAULT_KEEPALIVE, KeepalivePolicy
from ._layout import DTYPE_ITEMSIZE, PageLayout
from ._local_identity import CREDENTIAL_METADATA_KEY, credential_path_of
from ._security import BEARER_METADATA_KEY, PEER_TOKEN_METADATA_KEY, PLAIN, ChannelSecurity
from ._session import fetch_credential, find_credential_path
from ._tokens import TokenFile, TokenFileError

__all__ = [
    "BEARER_METADATA_KEY",
    "CREDENTIAL_METADATA_KEY",
    "DEFAULT_KEEPALIVE",
    "DTYPE_ITEMSIZE",
    "PEER_TOKEN_METADATA_KEY",
    "PLAIN",
    "ChannelSecurity",
    "KeepalivePolicy",
    "PageLayout",
    "TokenFile",
    "TokenFileError",
    "channel_options",
    "credential_path_of",
    "fetch_credential",
    "find_credential_path",
    "message_size_options",
]
