"""Trace files are checked line by line, once, in :func:`scheduler.trace.read_trace`:
every malformed line raises :class:`TraceError` naming the file and line (never a raw
``OverflowError``, ``UnicodeDecodeError``, ``KeyError``...), through ``load_trace`` and
through ``bench.store_trace.load``, which adds its own checks on ``hash_ids`` before any
server starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import store_trace
from scheduler.errors import TraceError
from scheduler.trace import load_trace, read_trace

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\n'
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def _line(**fields: object) -> str:
    base: dict[str, object] = {"timestamp": 5, "input_length": 10, "output_length": 1,
                               "hash_ids": [1]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}) + "\n"


BAD: list[tuple[str, bytes, str]] = [
    ("not JSON", b"not json\n", "Expecting value"),
    ("not UTF-8", b"\xff\xfe garbage\n", "not UTF-8"),
    ("a list", b"[1, 2, 3]\n", "JSON object, not list"),
    ("no timestamp", _line(timestamp=...).encode(), "no 'timestamp'"),
    ("no input_length", _line(input_length=...).encode(), "no 'input_length'"),
    ("timestamp Infinity", b'{"timestamp": Infinity, "input_length": 10, '
                           b'"output_length": 1}\n', "Infinity"),
    ("timestamp NaN", b'{"timestamp": NaN, "input_length": 10, "output_length": 1}\n',
     "NaN"),
    ("timestamp 1e400", b'{"timestamp": 1e400, "input_length": 10, "output_length": 1}\n',
     "timestamp"),
    ("timestamp 1e300", _line(timestamp=1e300).encode(), "timestamp 1e+300"),
    ("timestamp a huge int", _line(timestamp=10**400).encode(), "timestamp of 401 digits"),
    ("negative timestamp", _line(timestamp=-1).encode(), "timestamp -1"),
    ("timestamp a string", _line(timestamp="x").encode(), "timestamp \"x\""),
    ("input_length 1e23", _line(input_length=10**23).encode(), "input_length 1000"),
    ("output_length 2**63", _line(output_length=1 << 63).encode(), "output_length"),
    ("input_length 0", _line(input_length=0).encode(), "input_length 0"),
    ("input_length a float", _line(input_length=10.0).encode(), "input_length 10.0"),
    ("input_length true", _line(input_length=True).encode(), "input_length true"),
    ("hash_ids a string", _line(hash_ids="123").encode(), "hash_ids is a str"),
    ("a bool id", _line(hash_ids=[True]).encode(), "hash_ids[0] true"),
    ("a negative id", _line(hash_ids=[2, -1]).encode(), "hash_ids[1] -1"),
    ("an id of 2**64", _line(hash_ids=[1 << 64]).encode(), "hash_ids[0]"),
    ("more ids than tokens", _line(input_length=2, hash_ids=[1, 2, 3]).encode(),
     "3 hash_ids for 2 prompt tokens"),
    ("nested too deep", b"[" * 100_000 + b"\n", "bad request"),
]


@pytest.mark.parametrize("line,needle", [(b, n) for _, b, n in BAD],
                         ids=[name for name, _, _ in BAD])
def test_a_bad_line_names_file_and_line(tmp_path: Path, line: bytes, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + line + GOOD.encode())
    for load in (load_trace, lambda p: store_trace.load(str(p), None)):
        with pytest.raises(TraceError) as caught:
            load(path)
        assert "bad.jsonl:3: bad request: " in str(caught.value)
        assert needle in str(caught.value)


def test_lines_past_the_limit_are_not_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes((GOOD * 3).encode() + b"\xff not read\n")
    assert len(load_trace(path, limit=3)) == 3
    assert [r.line for r in read_trace(path, limit=2)] == [1, 2]
    assert len(store_trace.load(str(path), 3)) == 3


def test_store_trace_checks_its_hash_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    for line, needle in [(_line(hash_ids=...), "no 'hash_ids'"),
                         (_line(input_length=10, hash_ids=[1, 2, 1]), "repeat an id"),
                         (_line(input_length=70_000, hash_ids=list(range(65_537))),
                          "65537 hash_ids, over the 65536")]:
        path.write_text(GOOD + line)
        with pytest.raises(TraceError, match=f"t.jsonl:2: bad request: .*{needle}"):
            store_trace.load(str(path), None)
        load_trace(path)  # the simulator needs none of these
    path.write_text("\n  \n")
    with pytest.raises(TraceError, match="holds no requests"):
        store_trace.load(str(path), None)
    with pytest.raises(SystemExit, match="store_trace: .*holds no requests"):
        store_trace.main(["--trace", str(path), "--capacity-blocks", "10"])


def test_good_lines_load_as_before(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 100, "input_length": 1024, "output_length": 0, '
                    '"hash_ids": [18446744073709551615, 0]}\n'
                    '{"timestamp": 2.5, "input_length": 9223372036854775807, '
                    '"output_length": 9223372036854775807}\n')
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 0.0975]
    assert trace.input_tokens.tolist() == [(1 << 63) - 1, 1024]
    assert trace.keys == [(), (0, 1)]
    with pytest.raises(TraceError, match="t.jsonl:2: bad request: no 'hash_ids'"):
        store_trace.load(str(path), None)


@pytest.mark.skipif(not TRACE.exists(), reason=f"trace not found at {TRACE}")
def test_the_conversation_trace_passes_every_check() -> None:
    trace = load_trace(TRACE)
    ids = store_trace.load(str(TRACE), None)
    assert len(trace) == len(ids) > 10_000
    assert sum(map(len, ids)) == sum(map(len, trace.keys))
