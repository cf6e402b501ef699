"""Flood a running ``openinfer serve`` with idle and slowloris sockets on loopback and report what it did with them.

``--idle`` sockets never send a byte; ``--slow`` sockets send a request head one byte every ``--slow-interval``
seconds and never finish it. Meanwhile ``/health`` is probed on a fresh connection every ``--probe-interval``.
The report (JSON): sockets opened, how many the server closed and after how long (p50 / min / max per kind, and
how many got a 408), /health latency p50 / p99 / max and errors, and - with ``--server-log`` - the lines the server
wrote to its log during the flood and how many of them were tracebacks. ``--over-cap N`` then opens N sockets at
once to pass ``--max-connections`` and reports how many were refused with a 503 and how fast.

The soft RLIMIT_NOFILE of this process is raised to fit the sockets (up to the hard limit). Exit code 0 when every
socket was closed by the server, /health never failed, and the log has no traceback. For example:

    python -m openinfer serve --model <small model> --port 8000 --header-timeout-s 5 > serve.log 2>&1 &
    python scripts/slowloris.py --port 8000 --idle 2500 --slow 500 --server-log serve.log \\
        --out benchmarks/results/slowloris/slowloris.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from openinfer.bench import slowloris


def _log_size(path: str | None) -> int:
    return Path(path).stat().st_size if path else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--idle", type=int, default=2500, help="sockets that never send a byte")
    p.add_argument("--slow", type=int, default=500, help="sockets that send a header byte every --slow-interval")
    p.add_argument("--slow-interval", type=float, default=1.0)
    p.add_argument("--probe-interval", type=float, default=0.1, help="seconds between /health probes")
    p.add_argument("--wait-s", type=float, default=20.0,
                   help="how long to wait for the server to close the flood (past its --header-timeout-s)")
    p.add_argument("--over-cap", type=int, default=0, help="then open this many sockets at once (0: skip)")
    p.add_argument("--server-log", default=None, help="the server's log file: lines written during the run")
    p.add_argument("--out", default=None, help="write the JSON report here too")
    args = p.parse_args(argv)

    log_start = _log_size(args.server_log)
    t0 = time.time()
    report: dict = {"command": " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
                    "started_unix_s": round(t0, 1)}
    report["flood"] = slowloris.flood(args.host, args.port, args.idle, args.slow, args.wait_s, args.slow_interval,
                                      args.probe_interval)
    if args.over_cap:
        report["over_cap"] = slowloris.over_cap(args.host, args.port, args.over_cap)
    report["duration_s"] = round(time.time() - t0, 2)
    if args.server_log:
        time.sleep(0.5)  # let the last lines reach the file
        with open(args.server_log, "rb") as f:
            f.seek(log_start)
            lines = f.read().decode(errors="replace").splitlines()
        report["server_log"] = {"lines": len(lines), "bytes": _log_size(args.server_log) - log_start,
                                "traceback_lines": sum("Traceback" in ln for ln in lines), "sample": lines[:10]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    flood = report["flood"]
    closed_all = all(flood[k]["closed_by_server"] == flood[k]["opened"] for k in ("idle", "slow") if k in flood)
    ok = closed_all and flood["health"]["errors"] == 0 and report.get("server_log", {}).get("traceback_lines", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
