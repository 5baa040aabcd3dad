"""Mooncake's metadata modes on our control plane, and an HTTP metadata server.

Mooncake engines find each other by *segment name* (``local_hostname`` given to
``initialize``) through a metadata service:

- ``P2PHANDSHAKE``: no service; the name is ``host:rpc_port`` and says where the peer
  listens (:class:`P2PDirectory`).
- ``http://host:port/metadata``: a key-value service; ``GET``/``PUT``/``DELETE
  /metadata?key=K``, 200 on success, 404 for a missing key, 400 for a second ``PUT`` of
  a ``rpc_meta`` key (:class:`HttpDirectory` is the client, :class:`MetadataServer` the
  server, wire-compatible with Mooncake's ``mooncake_http_metadata_server``).
- ``etcd://host:port`` (or a bare ``host:port``, Mooncake's default; several endpoints
  separated by ``,`` or ``;``): the same keys in etcd, through its v3 JSON gateway
  (:class:`EtcdDirectory`).
- ``redis://[[user]:password@]host[:port][/db]``: the same keys in redis, over RESP by
  hand (:class:`RedisDirectory`; credentials also from Mooncake's ``$MC_REDIS_USERNAME``,
  ``$MC_REDIS_PASSWORD``, ``$MC_REDIS_DB_INDEX``).

Keys, as Mooncake writes them (``<prefix>`` is ``mooncake/`` plus
``$MC_METADATA_CLUSTER_ID/`` when set):

- ``<prefix>rpc_meta/<name>`` -> ``{"ip_or_host_name": ..., "rpc_port": ...}``: where the
  engine's handshake listens. Here that is our control endpoint.
- ``<prefix>ram/<name>`` -> ``{"name", "protocol", "buffers": [{"name", "addr",
  "length"}]}``: the registered memory, for people and tools; our peers learn segments
  from the handshake itself.

In etcd and redis the values are byte for byte what Mooncake's plugins write (compact
JSON, keys sorted, a trailing newline: :func:`mooncake_json`), without a lease or TTL,
so Mooncake's engines and ours read each other's entries. Mooncake's plugins overwrite
an ``rpc_meta`` key; here it is created only when absent (etcd: a transaction on the
key's create revision; redis: ``SET NX``) and replaced only when it is stale, as the
HTTP server's first-writer rule has it. Closing deletes our keys while they still hold
what we wrote (etcd: a transaction on the value; redis: a short Lua script).

Authentication: with a control secret (``TE_CONTROL_SECRET``) the server answers only
requests carrying ``X-TE-Signature``: our HMAC frame head (``control/auth.py``) over
``METHOD\\nKEY\\nsha256(body)``, with its timestamp window and replay check. Replies are
not signed: a forged reply can at most point a client to an endpoint, whose handshake
is signed. Without a secret the server serves loopback only (``TE_ALLOW_INSECURE=1`` to
opt out), like every other port of the project.
etcd and redis are the operator's to secure (etcd's TLS and users are not spoken here;
redis's ``AUTH`` is); their entries are not signed, and as with a forged HTTP reply, a
forged entry can only point an engine at an endpoint whose handshake is signed.

Where each piece lives: :mod:`.directory` (the interface, P2P, shared helpers),
:mod:`.http_directory`, :mod:`.store_directory` with :mod:`.etcd_directory` and
:mod:`.redis_directory`, :mod:`.signing` and :mod:`.metadata_server`; this module
chooses among them (:func:`open_directory`) and names them all.
"""

from __future__ import annotations

from transfer_engine.control.auth import Signer

from .directory import (
    P2PHANDSHAKE,
    Directory,
    DirectoryError,
    Location,
    P2PDirectory,
    key_prefix,
    probe,
    split_hostport,
)
from .etcd_directory import EtcdDirectory
from .http_directory import HttpDirectory
from .metadata_server import MetadataServer, main
from .redis_directory import RedisDirectory, RedisError, RespConnection
from .signing import SIGNATURE_HEADER, sign_request, verify_request
from .store_directory import mooncake_json

__all__ = ["P2PHANDSHAKE", "Location", "DirectoryError", "Directory", "P2PDirectory",
           "HttpDirectory", "EtcdDirectory", "RedisDirectory", "RespConnection",
           "RedisError", "MetadataServer", "mooncake_json", "open_directory",
           "split_hostport", "main", "SIGNATURE_HEADER", "key_prefix", "probe",
           "sign_request", "verify_request"]


def open_directory(conn_string: str, signer: Signer | None) -> Directory:
    """The directory for a Mooncake metadata connection string: ``P2PHANDSHAKE``,
    ``http(s)://``, ``etcd://`` (also a bare ``host:port``, as Mooncake) or
    ``redis://``. Raises ``ValueError`` for other schemes and malformed strings. The
    signer authenticates requests to our HTTP server; etcd and redis have their own."""
    if conn_string == P2PHANDSHAKE:
        return P2PDirectory()
    scheme, sep, _ = conn_string.partition("://")
    if not sep:
        scheme = "etcd"  # Mooncake's default for a bare host:port
    if scheme in ("http", "https"):
        return HttpDirectory(conn_string, signer)
    if scheme == "etcd":
        return EtcdDirectory(conn_string)
    if scheme == "redis":
        return RedisDirectory(conn_string)
    raise ValueError(
        f"metadata server {conn_string!r}: {scheme} is not supported; use P2PHANDSHAKE, "
        "http://host:port/metadata (`te-mooncake metadata-server`), etcd://host:port or "
        "redis://host:port")

