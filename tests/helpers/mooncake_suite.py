"""Runs Mooncake's own transfer-engine Python tests, unchanged, against ``mooncake.engine``.

    PYTHONPATH=$PWD python3 -m tests.helpers.mooncake_suite --src MOONCAKE_CHECKOUT \
        [--mode p2p|http|etcd|redis|both|all] [--python PY] [--real]

``--src``: a Mooncake source checkout (only its test and example scripts are read).
By default the scripts run on this project through the ``mooncake`` shim; ``--real``
runs them on whatever ``mooncake`` the ``--python`` interpreter imports (a venv with
Mooncake's wheel), to compare. Prints one line per test and ``passed/total``; exits 0
when every test that can pass here passed.

The scripts and what is counted (12 tests per mode):

- ``mooncake-wheel/tests/transfer_engine_initiator_test.py`` (6 unittest cases) against
  ``transfer_engine_target.py``;
- ``mooncake-wheel/tests/test_import_structure.py`` (3 cases; two use ``mooncake.store``
  and ``BufferPool``, which the KV store provides);
- ``mooncake-transfer-engine/example/batch_register_bench.py`` and
  ``kvcache_prefix_bench.py`` (target + initiator; pass: exit 0, no failed transfer);
- ``mooncake-transfer-engine/tests/rpc_communicator_test.py`` (server + client for a few
  seconds; pass: the client reports bandwidth, i.e. the server took its messages, and no
  error).

P2P mode: Mooncake's target listens on a port of its own choosing and its test prints
only the name it was given, so the harness finds the port as an operator would: the
target's listening sockets (``/proc``), the one that answers ``send_probe``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.etcd_server import etcd_server
from bench.fleet import free_port
from tests.helpers.redis_helpers import redis_server

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "transfer_engine" / "connectors" / "mooncake" / "shim"
WHEEL_TESTS = "mooncake-wheel/tests"
EXAMPLES = "mooncake-transfer-engine/example"
RPC_TEST = "mooncake-transfer-engine/tests/rpc_communicator_test.py"


@dataclass
class Result:
    name: str
    passed: bool
    detail: str = ""


class Runner:
    """Starts the scripts with the chosen ``mooncake`` and collects results."""

    def __init__(self, src: Path, python: str, real: bool, workdir: Path) -> None:
        self.src = src
        self.python = python
        self.real = real
        self.workdir = workdir
        self.env = dict(os.environ)
        if not real:
            paths = [str(SHIM), str(ROOT), self.env.get("PYTHONPATH", "")]
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.env.setdefault("CIRCLE", "100")  # the initiator test's own knob
        self.env["PYTHONUNBUFFERED"] = "1"

    def popen(self, args: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen([self.python, *args], env={**self.env, **(env or {})},
                                cwd=cwd or self.workdir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    @contextmanager
    def background(self, args: list[str], env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> Iterator[subprocess.Popen[str]]:
        proc = self.popen(args, env, cwd)
        try:
            yield proc
        finally:
            stop(proc)

    def run(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> tuple[int, str]:
        proc = self.popen(args, env, cwd)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return 124, out
        return proc.returncode, out

    def find_rpc_port(self, pid: int, host: str = "127.0.0.1", timeout: float = 30) -> int:
        """The port of ``pid`` that answers a Mooncake ``send_probe``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for port in listening_ports(pid):  # one process each: a probe may hang
                code = ("from mooncake.engine import TransferEngine\n"
                        "e = TransferEngine()\n"
                        f"assert e.initialize('{host}', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
                        f"print('PROBE', e.send_probe('{host}:{port}'))\n")
                rc, out = self.run(["-c", code], timeout=10)
                if re.search(r"^PROBE 0$", out, re.M):
                    return port
            time.sleep(0.2)
        raise RuntimeError(f"no port of process {pid} answers a probe")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(5)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


def listening_ports(pid: int) -> list[int]:
    """TCP ports ``pid`` listens on (from /proc)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return []
    ports = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


_SEEN: dict[int, list[str]] = {}  # output lines read so far, per process


def drain(proc: subprocess.Popen[str]) -> str:
    """Stops ``proc`` and returns all its output, what :func:`wait_for` read included."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    rest = ""
    if proc.stdout is not None and not proc.stdout.closed:
        os.set_blocking(proc.stdout.fileno(), True)
        rest = proc.stdout.read()
    return "".join(_SEEN.pop(proc.pid, [])) + rest


def wait_for(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> str:
    """Reads ``proc``'s output until a line matches ``pattern``; returns the match."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = _SEEN.setdefault(proc.pid, [])
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found.group(1) if found.groups() else line
            continue
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"never printed {pattern!r}:\n{''.join(seen)[-2000:]}")


def unittest_counts(out: str) -> tuple[int, int]:
    ran = re.search(r"^Ran (\d+) tests?", out, re.M)
    total = int(ran.group(1)) if ran else 0
    bad = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", out))
    return total - bad, total


def unittest_results(name: str, out: str, expected: int) -> list[Result]:
    ok, total = unittest_counts(out)
    failed = re.findall(r"^(?:FAIL|ERROR): (\S+)", out, re.M)
    results = [Result(f"{name}::{f}", False) for f in failed]
    results += [Result(f"{name}::ok#{i}", True) for i in range(ok)]
    results += [Result(f"{name}::not-run#{i}", False, out[-1500:])
                for i in range(expected - max(total, ok + len(failed)))]
    return results


def run_mode(r: Runner, mode: str) -> list[Result]:
    with metadata_service(r, mode) as metadata:
        return run_tests(r, mode, metadata)


@contextmanager
def metadata_service(r: Runner, mode: str) -> Iterator[str]:
    """Starts the mode's metadata service; yields the connection string to pass."""
    if mode == "p2p":
        yield "P2PHANDSHAKE"
    elif mode == "etcd":
        data = r.workdir / "etcd-data"
        data.mkdir(exist_ok=True)
        with etcd_server(data) as url:
            yield url
    elif mode == "redis":
        with redis_server() as url:
            yield url
    else:
        yield from http_metadata_server(r)


def http_metadata_server(r: Runner) -> Iterator[str]:
    port = free_port()
    if r.real:
        server = r.popen(["-c", "from mooncake.http_metadata_server import main; main()",
                          "--port", str(port), "--host", "127.0.0.1"])
    else:
        server = r.popen(["-m", "transfer_engine.connectors.mooncake", "metadata-server",
                          "--port", str(port), "--host", "127.0.0.1"])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the metadata server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/metadata"
    finally:
        stop(server)


def run_tests(r: Runner, mode: str, metadata: str) -> list[Result]:
    results: list[Result] = []
    meta_env = {"MC_METADATA_SERVER": metadata}
    # 1. the wheel's initiator test against its target
    tests = r.src / WHEEL_TESTS
    target_name = f"127.0.0.1:{free_port()}"
    env = {**meta_env, "TARGET_SERVER_NAME": target_name,
           "INITIATOR_SERVER_NAME": f"127.0.0.1:{free_port()}", "PROTOCOL": "tcp"}
    with r.background([str(tests / "transfer_engine_target.py")], env, tests) as target:
        wait_for(target, r"(Target server ready)")
        if mode == "p2p":
            env["TARGET_SERVER_NAME"] = f"127.0.0.1:{r.find_rpc_port(target.pid)}"
        rc, out = r.run([str(tests / "transfer_engine_initiator_test.py")], env,
                        cwd=tests)
    results += unittest_results("transfer_engine_initiator_test", out, 6)
    # 2. the import test
    rc, out = r.run([str(tests / "test_import_structure.py")], meta_env, cwd=tests)
    results += unittest_results("test_import_structure", out, 3)
    # 3. the two examples, target then initiator
    examples = r.src / EXAMPLES
    for script, target_args, initiator_args in (
            ("batch_register_bench.py",
             ["--num_blocks", "4", "--block_size_gb", "0.0625"],
             ["--num_blocks", "4", "--block_size_gb", "0.0625", "--transfer_size_mb",
              "16", "--iterations", "5", "--warmup", "1"]),
            ("kvcache_prefix_bench.py", ["--pool_size_gb", "0.25"],
             ["--pool_size_gb", "0.25", "--prefix_tokens", "64,256",
              "--kv_bytes_per_token", "40960", "--iterations", "5", "--warmup", "1",
              "--threads", "2"])):
        results.append(run_example(r, examples / script, metadata, target_args,
                                   initiator_args))
    # 4. the RPC communicator test
    results.append(run_rpc(r))
    return results


def run_example(r: Runner, script: Path, metadata: str, target_args: list[str],
                initiator_args: list[str]) -> Result:
    name = f"{script.name}"
    local = f"127.0.0.1:{free_port()}"
    common = ["--metadata_server", metadata, "--protocol", "tcp"]
    with r.background([str(script), "--mode", "target", "--local_server_name", local,
                       *common, *target_args]) as target:
        try:
            if metadata == "P2PHANDSHAKE":
                actual = wait_for(target, r"Actual server name: (\S+)")
            else:
                actual = local
            wait_for(target, r"(TARGET_INFO:)")
        except RuntimeError as exc:
            return Result(name, False, f"target: {exc}")
        with tempfile.TemporaryDirectory() as cwd:
            rc, out = r.run([str(script), "--mode", "initiator", "--local_server_name",
                             f"127.0.0.1:{free_port()}", "--target_server_name", actual,
                             *common, *initiator_args], cwd=Path(cwd))
    bad = re.search(r"FAILED|ERROR|ALL FAILED|Traceback|errors: [1-9]", out)
    return Result(name, rc == 0 and not bad, "" if rc == 0 and not bad else out[-2000:])


def run_rpc(r: Runner) -> Result:
    script = str(r.src / RPC_TEST)
    port = free_port()
    with r.background([script, "server", "--url", f"127.0.0.1:{port}", "--data-size", "1"]
                      ) as server:
        try:
            wait_for(server, r"(Server started on)")
        except RuntimeError as exc:
            return Result("rpc_communicator_test", False, str(exc))
        with r.background([script, "client", "--url", f"127.0.0.1:{port}", "--threads", "2",
                           "--data-size", "1"]) as client:
            try:  # the client counts what the server accepted
                wait_for(client, r"(bandwidth:)", timeout=20)
                ok, detail = True, ""
            except RuntimeError as exc:
                ok, detail = False, str(exc)
            time.sleep(1)
            out = drain(client)
    if "error" in out.lower():
        ok, detail = False, out[-2000:]
    return Result("rpc_communicator_test", ok, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, type=Path, help="a Mooncake checkout")
    parser.add_argument("--mode", choices=["p2p", "http", "etcd", "redis", "both", "all"],
                        default="both", help="both: p2p and http; all: the four")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--real", action="store_true",
                        help="run on the mooncake that --python imports, not the shim")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    failed_total = 0
    with tempfile.TemporaryDirectory() as work:
        runner = Runner(args.src, args.python, args.real, Path(work))
        modes = {"both": ["p2p", "http"], "all": ["p2p", "http", "etcd", "redis"]}
        for mode in modes.get(args.mode, [args.mode]):
            results = run_mode(runner, mode)
            passed = sum(res.passed for res in results)
            for res in results:
                print(f"  [{mode}] {'PASS' if res.passed else 'FAIL'} {res.name}")
                if args.verbose and res.detail:
                    print("      " + res.detail.replace("\n", "\n      "))
            print(f"{mode}: {passed}/{len(results)} passed", flush=True)
            failed_total += len(results) - passed
    return 0 if failed_total == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
