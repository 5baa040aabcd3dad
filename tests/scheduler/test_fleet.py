"""The fleet view follows registry membership (through the real in-process store) and
load reports."""

from __future__ import annotations

from scheduler.fleet import Fleet
from transfer_engine.control.metastore import MemberRecord, MemoryStore


def _record(name: str, role: str, url: str = "", **http: object) -> MemberRecord:
    transports = {"http": {"url": url, **http}} if url else {}
    return MemberRecord(name, "inc-" + name, role=role, host="h-" + name, pod="pa",
                        zone="z1", transports=transports)


def test_fleet_follows_registry_events() -> None:
    store = MemoryStore()
    fleet = Fleet(require_url=True, kv_tokens=1000)
    store.put(_record("p0", "prefill", "http://127.0.0.1:1"))
    with fleet.watch(store):
        store.put(_record("d0", "decode", "http://127.0.0.1:2", kv_tokens=5000))
        store.put(_record("e0", "prefill"))  # no URL: not routable over HTTP
        store.put(_record("s0", "store", "http://127.0.0.1:3"))
        assert fleet.prefill.names == ["p0"] and fleet.decode.names == ["d0"]
        assert fleet.decode.kv_cap[0] == 5000 and fleet.prefill.urls[0].endswith(":1")
        store.put(_record("d0", "decode", "http://127.0.0.1:2", kv_tokens=5000,
                          load={"queue": 3, "kv_used": 1200}))
        assert fleet.decode.queue[0] == 3 and fleet.decode.kv_used[0] == 1200
        fleet.prefix.insert(0, [1, 2])
        store.delete("p0")
        assert not fleet.prefill.usable().any() and fleet.prefix.overlaps([1]) == {}
        store.put(_record("p0", "prefill", "http://127.0.0.1:1"))  # rejoins, same slot
        assert fleet.prefill.usable().tolist() == [True]
        store.silence("d0")
        store.ttl = 0.0
        store.sweep()
        assert not fleet.decode.usable().any()


def test_report_and_bookkeeping() -> None:
    fleet = Fleet()
    p = fleet.add("p0", "prefill", pod="a")
    d = fleet.add("d0", "decode", pod="a")
    fleet.dispatched(p, d, [1, 2], prefill_s=2.0, kv_tokens=100, now=10.0)
    assert fleet.prefill.free_at[p] == 12.0 and fleet.decode.kv_used[d] == 100
    assert fleet.prefix.overlaps([1, 2]) == {p: 2}
    fleet.prefill_done(p, d, now=11.0)
    assert fleet.prefill.queue[p] == 0 and fleet.prefill.free_at[p] == 11.0
    fleet.decode_done(d, 100, now=20.0)
    assert fleet.decode.kv_used[d] == 0 and fleet.decode.queue[d] == 0
    fleet.report("d0", queue=4, kv_used=50.0)
    fleet.report("nobody", queue=1)
    assert fleet.decode.queue[d] == 4
    fleet.add("p0", "decode")  # a role change moves it
    assert not fleet.prefill.usable().any() and len(fleet.decode) == 2
    assert "Fleet" in repr(fleet)
