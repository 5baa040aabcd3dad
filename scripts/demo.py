"""Demo: a prefill worker hands a request's paged KV cache to a decode worker.

This process starts a membership registry in-process (no server to install) and plays
the prefill worker. The decode worker runs in a second process with its own vLLM-style KV
cache (one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``) and
joins the registry; the prefill worker finds it there by role, connects, writes the
request's blocks into the blocks the decode worker allocated, and the decode worker,
notified once every byte landed, checks them against a digest carried in the
notification. Runs once over the same-host path and once over TCP.

Then the KV store: an embedded master and a storage node (in-process), a first request
whose KV blocks are put under their chained block hashes, and a second request sharing
its prefix that finds how much of its prompt is stored (``longest_prefix``) and loads
those blocks from the node, checked byte for byte against the first request's.

    python3 scripts/demo.py [--layers 8] [--blocks 64] [--store-only]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from transfer_engine import Descriptor, Engine, Segment  # noqa: E402
from transfer_engine.control.registry import Registry  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 512, 16, 8, 128


def make_cache(layers: int, seed: int) -> list[Any]:
    """Per-layer KV tensors (torch bf16 when torch is installed, else numpy uint16)."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    rng = np.random.default_rng(seed)
    try:
        import torch
    except ImportError:
        return [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for _ in range(layers)]
    return [torch.from_numpy(rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.int16))
            .view(torch.bfloat16) for _ in range(layers)]


def block_spans(tensor: Any, block: int) -> list[tuple[int, int]]:
    """(byte offset, length) of the K and V parts of one block, from the tensor's strides."""
    if hasattr(tensor, "element_size"):
        item, strides = tensor.element_size(), [s * tensor.element_size() for s in tensor.stride()]
    else:
        item, strides = tensor.itemsize, list(tensor.strides)
    part = BLOCK_SIZE * KV_HEADS * HEAD_DIM * item
    return [(kv * strides[0] + block * strides[1], part) for kv in (0, 1)]


def as_bytes(tensor: Any) -> np.ndarray:
    if hasattr(tensor, "element_size"):  # torch: bf16 has no numpy dtype
        import torch

        tensor = tensor.view(torch.int16).numpy()
    return np.asarray(tensor).reshape(-1).view(np.uint8)


def digest(tensors: list[Any], blocks: list[int]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        raw = as_bytes(t)
        for block in blocks:
            for off, n in block_spans(t, block):
                h.update(raw[off:off + n].tobytes())
    return h.hexdigest()


def decode_worker(layers: int, transports: str, registry: str) -> None:
    cache = make_cache(layers, seed=2)
    with Engine("decode-0", transports=transports.split(","), registry=registry,
                role="decode") as engine:
        for i, t in enumerate(cache):
            engine.register(t, name=f"layer{i}")
        print("READY", flush=True)
        for _ in range(2):
            notes = engine.notifications(timeout=60, max_count=1)  # one per request
            if not notes:
                print("RESULT timeout", flush=True)
                return
            request = json.loads(notes[0].payload)
            ok = digest(cache, request["blocks"]) == request["sha256"]
            print("RESULT", "ok" if ok else "MISMATCH", notes[0].peer, flush=True)


def find_decode(engine: Engine, timeout: float = 10.0) -> str:
    """The name of a decode worker in the registry (it may take a heartbeat to show)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        members = engine.members("decode")
        if members:
            return members[0].name
        time.sleep(0.05)
    raise SystemExit("no decode worker joined the registry")


def run_pair(layers: int, blocks: int, transports: str, registry: str) -> None:
    proc = subprocess.Popen([sys.executable, __file__, "--role", "decode", "--layers",
                             str(layers), "--transports", transports, "--registry", registry],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "READY":
            raise SystemExit("decode worker did not start")
        cache = make_cache(layers, seed=1)
        rng = np.random.default_rng(0)
        src_blocks = sorted(rng.choice(NUM_BLOCKS, blocks, replace=False).tolist())
        dst_blocks = sorted(rng.choice(NUM_BLOCKS, blocks, replace=False).tolist())
        with Engine("prefill-0", transports=transports.split(","), registry=registry,
                    role="prefill") as engine:
            segs: list[Segment] = [engine.register(t) for t in cache]
            peer = engine.connect(find_decode(engine))  # by name, through the registry
            remote = [peer.segment(f"layer{i}") for i in range(layers)]
            pairs = []
            for layer, t in enumerate(cache):
                for sb, db in zip(src_blocks, dst_blocks, strict=True):
                    spans = zip(block_spans(t, sb), block_spans(t, db), strict=True)
                    for (so, n), (do, _) in spans:
                        pairs.append((Descriptor(segs[layer], so, n),
                                      Descriptor(remote[layer], do, n)))
            nbytes = sum(p[0].length for p in pairs)
            note = json.dumps({"blocks": dst_blocks,
                               "sha256": digest(cache, src_blocks)}).encode()
            engine.write(peer, pairs, notify=note).wait(30)  # warm-up: connections, pages
            start = time.perf_counter()
            handle = engine.write(peer, pairs, notify=note)
            handle.wait(30)
            elapsed = time.perf_counter() - start
        results = [proc.stdout.readline().split() for _ in range(2)]
        proc.wait(30)
        ok = all(r[:2] == ["RESULT", "ok"] for r in results)
        print(f"  {handle.transport:>4}: {blocks} blocks x {layers} layers "
              f"({len(pairs)} descriptors, {nbytes / 2**20:.1f} MiB) in "
              f"{elapsed * 1e3:.1f} ms = {nbytes / elapsed / 1e9:.2f} GB/s; decode worker "
              f"verified the bytes: {'yes' if ok else 'NO'}")
        if not ok:
            raise SystemExit(f"verification failed: {results}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def store_demo(layers: int, blocks: int) -> None:
    """Request 1 puts its KV blocks into the store; request 2 loads its shared prefix."""
    from kvstore import block_hashes
    from kvstore.client import Client
    from kvstore.master import Master
    from kvstore.node import StorageNode

    cache = make_cache(layers, seed=3)
    block_bytes = sum(n for t in cache[:1] for _, n in block_spans(t, 0)) * layers

    def kv_of(block: int) -> bytes:
        """One block's K and V of every layer, as the store keeps it."""
        parts = []
        for t in cache:
            raw = as_bytes(t)
            parts += [raw[off:off + n].tobytes() for off, n in block_spans(t, block)]
        return b"".join(parts)

    rng = np.random.default_rng(4)
    prompt1 = rng.integers(0, 32000, blocks * BLOCK_SIZE)
    shared = blocks // 2
    prompt2 = np.concatenate((prompt1[:shared * BLOCK_SIZE],
                              rng.integers(0, 32000, (blocks - shared) * BLOCK_SIZE)))
    keys1, keys2 = block_hashes(prompt1, BLOCK_SIZE), block_hashes(prompt2, BLOCK_SIZE)
    capacity = max(64 << 20, 2 * blocks * block_bytes)
    with Master("tcp://127.0.0.1:0") as master, \
            StorageNode(master.endpoint, capacity, name="store-0") as node, \
            Client(master.endpoint, checksum=True) as client:
        master.wait_nodes(1)
        kv1 = [kv_of(b) for b in range(blocks)]  # request 1's blocks 0..n-1
        start = time.perf_counter()
        client.batch_put(keys1, kv1)
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        hit = client.longest_prefix(keys2)
        loaded = client.batch_get(keys2[:hit], verify=True)
        get_s = time.perf_counter() - start
        ok = hit == shared and loaded == kv1[:hit]
        nbytes = hit * block_bytes
        print(f"store at {master.endpoint} (in-process, node {node.name!r}): request 1 put "
              f"{blocks} blocks ({blocks * block_bytes / 2**20:.1f} MiB) in "
              f"{put_s * 1e3:.1f} ms; request 2 found {hit} of {len(keys2)} blocks stored "
              f"and loaded {nbytes / 2**20:.1f} MiB in {get_s * 1e3:.1f} ms; bytes "
              f"checked: {'yes' if ok else 'NO'}")
        if not ok:
            raise SystemExit("the store returned other bytes than were put")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64, help="blocks of the request")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--registry", help="registry endpoint (default: start one here)")
    parser.add_argument("--store-only", action="store_true", help="only the KV store part")
    args = parser.parse_args()
    if args.role == "decode":
        decode_worker(args.layers, args.transports, args.registry)
        return
    if args.store_only:
        store_demo(args.layers, args.blocks)
        return
    with Registry("tcp://127.0.0.1:0") as registry:
        print(f"registry at {registry.endpoint} (in-process); prefill -> decode, KV cache "
              f"[2, {NUM_BLOCKS}, {BLOCK_SIZE}, {KV_HEADS}, {HEAD_DIM}] bf16 per layer, "
              f"{args.blocks} scattered blocks per layer:")
        run_pair(args.layers, args.blocks, "shm,tcp", registry.endpoint)
        run_pair(args.layers, args.blocks, "tcp", registry.endpoint)
    store_demo(args.layers, args.blocks)


if __name__ == "__main__":
    main()
