"""Code written for Mooncake's ``MooncakeDistributedStore`` runs on the cluster store:
two such clients in one process, each lending memory as Mooncake clients do."""

from __future__ import annotations

import numpy as np

from kvstore.master import Master
from kvstore.mooncake_store import ErrorCode, MooncakeDistributedStore, ReplicateConfig


def test_mooncake_calls_and_return_codes() -> None:
    rng = np.random.default_rng(11)
    with Master() as master:
        addr = master.endpoint.split("://", 1)[1]
        a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
        try:
            assert a.setup("127.0.0.1", "http://unused", 16 << 20, 4 << 20, "tcp", "",
                           addr) == 0
            assert b.setup("127.0.0.1", "http://unused", 16 << 20, 4 << 20, "tcp", "",
                           addr) == 0
            master.wait_nodes(2)
            value = rng.bytes(100_000)
            assert a.put("layer0/block7", value, ReplicateConfig(replica_num=2)) == 0
            assert b.get("layer0/block7") == value
            assert b.get("missing") == b""
            assert b.is_exist("layer0/block7") == 1 and b.is_exist("missing") == 0
            assert b.batch_is_exist(["layer0/block7", "missing"]) == [1, 0]
            assert a.put("layer0/block7", b"other") == 0  # stored keys keep their value
            assert b.get("layer0/block7") == value
            assert b.get_size("layer0/block7") == len(value)
            assert b.get_size("missing") == ErrorCode.OBJECT_NOT_FOUND

            src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
            dst = np.zeros(1 << 20, dtype=np.uint8)
            ps, pd = int(src.ctypes.data), int(dst.ctypes.data)
            assert a.register_buffer(ps, src.nbytes) == 0
            assert b.register_buffer(pd, dst.nbytes) == 0
            keys = [f"k{i}" for i in range(8)]
            assert a.batch_put_from(keys, [ps + i * 65536 for i in range(8)],
                                    [65536] * 8) == [0] * 8
            got = b.batch_get_into(keys + ["nope"], [pd + i * 65536 for i in range(9)],
                                   [65536] * 9)
            assert got == [65536] * 8 + [ErrorCode.OBJECT_NOT_FOUND]
            assert np.array_equal(dst[:8 * 65536], src[:8 * 65536])
            assert b.get_into("k3", pd, 100) == ErrorCode.INVALID_PARAMS  # too small
            assert a.batch_put_from(["bad"], [12345], [10]) == [ErrorCode.INVALID_PARAMS]
            assert a.remove("k0") == 0 and a.remove("k0") == ErrorCode.OBJECT_NOT_FOUND
            assert a.batch_remove(["k1", "zz"]) == [0, ErrorCode.OBJECT_NOT_FOUND]
            assert a.unregister_buffer(ps) == 0 and a.unregister_buffer(ps) < 0
            assert b.unregister_buffer(pd) == 0
        finally:
            assert a.close() == 0 and b.close() == 0
