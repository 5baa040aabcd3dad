"""transfer_engine_bench's figures: the table rows it prints per run, the summary of
the runs (medians, ratios to the baselines) written as JSON, and its closing line."""

from __future__ import annotations

import argparse
import os
import platform
from typing import Any

from bench.stats import median

__all__ = ["header", "row", "control_signed", "summarize", "print_summary"]

_COLS = [("GB/s", "gbps", "{:8.3f}"), ("blocks/s", "ops_per_s", "{:10.0f}"),
         ("p50 us", "p50_us", "{:9.0f}"), ("p99 us", "p99_us", "{:9.0f}"),
         ("cpu/GB ini", "cpu_s_per_gb_initiator", "{:10.3f}"),
         ("cpu/GB tgt", "cpu_s_per_gb_target", "{:10.3f}")]
_BASE_COLS = [("sock GB/s", "baseline_socket_gbps", "{:9.3f}"),
              ("memcpy GB/s", "baseline_memcpy_gbps", "{:11.3f}")]


def header(baseline: bool) -> str:
    cols = _COLS + (_BASE_COLS if baseline else [])
    return f"{'':8}" + " ".join(f"{name:>{len(fmt.format(0))}}" for name, _, fmt in cols)


def row(label: str, run: dict[str, Any], baseline: bool) -> str:
    cols = _COLS + (_BASE_COLS if baseline else [])
    cells = []
    for _, key, fmt in cols:
        v = run.get(key)
        width = len(fmt.format(0))
        cells.append(fmt.format(v) if v is not None else f"{'-':>{width}}")
    return f"{label:8}" + " ".join(cells)


def control_signed() -> bool:
    """Whether this run's engines sign control messages (a control secret is set)."""
    from transfer_engine.control.auth import AuthConfig

    return AuthConfig.from_env().secret is not None


def summarize(a: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    runs = res["runs"]
    keys = ["gbps", "ops_per_s", "batches_per_s", "p50_us", "p99_us",
            "cpu_s_per_gb_initiator", "cpu_s_per_gb_target"]
    if runs and "host_us_per_wr" in runs[0]:
        keys += ["host_us_per_wr", "host_cpu_s_per_gb"]
    out: dict[str, Any] = {
        "protocol": a.protocol, "transport": res["transport"], "operation": a.operation,
        "block_size": a.block_size, "batch_size": a.batch_size, "threads": a.threads,
        "rails": res["rails"], "congestion": res.get("congestion"), "spread": a.spread,
        "api": a.api, "slice_size": a.slice_size, "emulated": a.emulated,
        "contiguous": a.contiguous, "use_vram": a.use_vram,
        "duration": a.duration, "repeat": a.repeat, "buffer_size": a.buffer_size,
        "coalescable_pairs": res["coalescable_pairs"],
        "authenticated": control_signed(),  # main() says for runs with --secret-file
    }
    for k in keys:
        out[k] = median([r[k] for r in runs])
    ci, ct = out["cpu_s_per_gb_initiator"], out["cpu_s_per_gb_target"]
    out["cpu_s_per_gb_total"] = median(
        [r["cpu_s_per_gb_initiator"] + r["cpu_s_per_gb_target"] for r in runs
         if r["cpu_s_per_gb_initiator"] is not None and r["cpu_s_per_gb_target"] is not None]
    ) if ci is not None and ct is not None else None
    if a.baseline:
        sock = median([r["baseline_socket_gbps"] for r in runs])
        mem = median([r["baseline_memcpy_gbps"] for r in runs])
        out["baseline_socket_gbps"] = sock
        out["baseline_memcpy_gbps"] = mem
        out["baseline_socket_cpu_s_per_gb"] = median(
            [r["baseline_socket_cpu_s_per_gb"] for r in runs])
        out["baseline_socket_congestion"] = runs[0].get("baseline_socket_congestion")
        # each run's engine figure against the baselines measured right after it: the
        # machine's mood changes between runs, less within one
        out["ratio_vs_socket"] = median([r["gbps"] / r["baseline_socket_gbps"] for r in runs
                                         if r["baseline_socket_gbps"]])
        out["ratio_vs_memcpy"] = median([r["gbps"] / r["baseline_memcpy_gbps"] for r in runs
                                         if r["baseline_memcpy_gbps"]])
        for way in ("d2h", "h2d"):  # --use_vram: device <-> pinned host copies
            if f"baseline_{way}_gbps" in runs[0]:
                out[f"baseline_{way}_gbps"] = median([r[f"baseline_{way}_gbps"]
                                                      for r in runs])
    out["verified"] = res["verified"]
    out["runs"] = runs
    out["engine_stats"] = res["engine_stats"]
    out["host"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                   "machine": platform.machine()}
    return out


def print_summary(a: argparse.Namespace, out: dict[str, Any]) -> None:
    print(row("median", out, a.baseline))
    extra = []
    if out.get("cpu_s_per_gb_total") is not None:
        extra.append(f"cpu/GB both sides {out['cpu_s_per_gb_total']:.3f}")
    if a.baseline:
        extra.append(f"socket cpu/GB both sides {out['baseline_socket_cpu_s_per_gb']:.3f}")
        sock_cc = out.get("baseline_socket_congestion")
        extra.append(f"vs socket {out['ratio_vs_socket']:.2f}x"
                     + (f" (socket under {sock_cc})" if sock_cc else ""))
        extra.append(f"vs memcpy {out['ratio_vs_memcpy']:.2f}x")
        if "baseline_d2h_gbps" in out:
            extra.append(f"GPU copies D2H {out['baseline_d2h_gbps']:.1f} GB/s, "
                         f"H2D {out['baseline_h2d_gbps']:.1f} GB/s")
    if out.get("host_us_per_wr") is not None:
        extra.append(f"host {out['host_us_per_wr']:.2f} us/WR, "
                     f"{out['host_cpu_s_per_gb']:.4f} cpu s/GB (emulated NIC, counting)")
    extra.append(f"verified {str(out['verified']).lower()}")
    extra.append("authenticated" if out.get("authenticated") else "no control secret")
    print("# " + ", ".join(extra), flush=True)
