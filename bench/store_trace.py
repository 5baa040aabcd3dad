"""Replays a request trace's block hashes through the cluster store and reports hit rates.

    python -m bench.store_trace --trace ../shared/traces/conversation_trace.jsonl \\
        --capacity-blocks 20000 --block-bytes 4096 --json results/store_trace.json

Each trace line's ``hash_ids`` are the chained block hashes of one request (one block per
id). Per request the client gets the request's blocks (one round trip to locate them,
then the reads), counts the stored prefix as hits (checked byte for byte: each block's
bytes are derived from its id), and puts the blocks after it, which it had to compute,
the way a serving engine stores blocks off its critical path: the put returns once the
bytes are written and the commit is sent (``wait=False``; the master takes it before the
next request's lookup, and a put that fails is reported at the end). The store
is a real master and ``--nodes`` storage nodes (processes on loopback) whose pools hold
``--capacity-blocks`` blocks in all. JSON: ``hit_rate`` (blocks loaded / blocks asked),
``bound`` (the hit rate of an unlimited cache on this trace), ``lru_hit_rate`` (an LRU
cache of the same number of blocks, same prefix rule), ``requests``, ``seconds``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from typing import Any

import numpy as np

from bench.baselines import Child
from bench.fleet import free_port
from kvstore.protocol import MAX_BATCH
from scheduler.errors import TraceError
from scheduler.trace import read_trace

__all__ = ["main"]


def load(path: str, limit: int | None) -> list[list[int]]:
    """The hash ids of each request of the trace (the first ``limit``), every line checked
    by :func:`scheduler.trace.read_trace` (ids in ``[0, 2**64)``), before any server
    starts. A request must also have ``hash_ids``, distinct and at most one store batch
    of them: the replay gets and puts them as one batch of distinct keys. Raises
    :class:`TraceError` naming the file and line."""
    out = []
    for req in read_trace(path, limit):
        ids = req.hash_ids
        if ids is None:
            why = "no 'hash_ids' (the replay reads and writes the blocks they name)"
        elif len(ids) > MAX_BATCH:
            why = f"{len(ids)} hash_ids, over the {MAX_BATCH} keys of one store batch"
        elif len(set(ids)) != len(ids):
            why = "hash_ids repeat an id (the replay puts them as distinct keys)"
        else:
            out.append(ids)
            continue
        raise TraceError(f"{path}:{req.line}: bad request: {why}")
    if not out:
        raise TraceError(f"trace {path} holds no requests")
    return out


def bound(trace: list[list[int]]) -> float:
    """Hit rate of an unlimited cache: a request loads the longest stored prefix."""
    seen: set[int] = set()
    hits = total = 0
    for ids in trace:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += n
        total += len(ids)
        seen.update(ids)
    return hits / max(1, total)


def lru(trace: list[list[int]], capacity: int) -> float:
    """Hit rate of an LRU cache of ``capacity`` blocks under the same prefix rule."""
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = total = 0
    for ids in trace:
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hits += n
        total += len(ids)
        for h in ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / max(1, total)


def block(h: int, size: int) -> bytes:
    """The bytes of block ``h``: distinct per id, never zeros."""
    word = np.uint64((h * 0x9E3779B97F4A7C15 + 1) & (2**64 - 1))
    seq = (np.arange(size // 8 + 1, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)) ^ word
    return seq.view(np.uint8)[:size].tobytes()


def replay(args: argparse.Namespace, trace: list[list[int]]) -> dict[str, Any]:
    from kvstore.client import Client

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    per_node = -(-args.capacity_blocks // args.nodes) * (-(-args.block_bytes // 64) * 64)
    hits = total = 0
    with Child(["-m", "kvstore.master", "--bind", endpoint]) as master:
        master.expect("kvstore-master serving", 30)
        nodes = [Child(["-m", "kvstore.node", "--master", endpoint, "--name", f"trace-n{i}",
                        "--capacity", str(per_node)]) for i in range(args.nodes)]
        try:
            for node in nodes:
                node.expect("kvstore-node", 60)
            with Client(endpoint, timeout=30.0) as client:
                start = time.perf_counter()
                for ids in trace:
                    keys = np.array(ids, dtype=np.uint64)
                    got = client.batch_get(keys)  # one lookup for the chain and its bytes
                    n = 0
                    while n < len(ids) and got[n] is not None:
                        if got[n] != block(ids[n], args.block_bytes):
                            raise SystemExit(f"store trace: block {ids[n]} came back wrong")
                        n += 1
                    hits += n
                    total += len(ids)
                    if n < len(ids):
                        client.batch_put(keys[n:], [block(h, args.block_bytes)
                                                    for h in ids[n:]], if_absent=True,
                                         wait=False)
                client.flush()  # raises if a put was not stored
                seconds = time.perf_counter() - start
                stats = client.stats()
        finally:
            for node in nodes:
                node.close()
    return {"hit_rate": hits / max(1, total), "seconds": seconds,
            "evictions": stats.get("evictions", 0), "puts_parked": stats.get("puts_parked", 0),
            "parked_s": stats.get("parked_us", 0) / 1e6}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="store_trace", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="../shared/traces/conversation_trace.jsonl")
    ap.add_argument("--capacity-blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        trace = load(args.trace, args.requests)
    except TraceError as exc:
        raise SystemExit(f"store_trace: {exc}") from exc
    result: dict[str, Any] = {"requests": len(trace), "capacity_blocks": args.capacity_blocks,
                              "block_bytes": args.block_bytes,
                              "unique_blocks": len({h for ids in trace for h in ids}),
                              "bound": bound(trace), "lru_hit_rate": lru(trace,
                                                                         args.capacity_blocks)}
    result.update(replay(args, trace))
    result["hit_rate_vs_bound"] = result["hit_rate"] / result["bound"] if result["bound"] else None
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
