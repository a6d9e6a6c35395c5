#!/usr/bin/env python3
"""Where the suite's CPU goes: each test file run alone in a cgroup of its own, its wall time and the CPU
seconds of everything it started (workers, servers, ansible-playbook and its forks, the test hosts' sshd
and the module runs under it: they stay in the cgroup however they daemonize).

    sudo .venv/bin/python scripts/suite_cpu.py [FILE ...] > cpu.txt    # every tests/*/test_*.py by default

Needs root and a cgroup v1 cpuacct hierarchy (/sys/fs/cgroup/cpuacct) or cgroup v2
(/sys/fs/cgroup/cgroup.procs). Prints one line a file, the largest CPU first at the end. Each run pays
its own pytest start (about 5 s of CPU: torch and the collection) that `make test` pays once a worker.
Run it on a quiet machine, and not beside another deploy run (the deploy tests' ports are fixed).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup")


def cpu_seconds(cg: Path) -> float:
    if (cg / "cpuacct.usage").exists():
        return int((cg / "cpuacct.usage").read_text()) / 1e9
    for line in (cg / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    raise SystemExit(f"{cg}: no CPU usage counter")


def main(argv: list[str]) -> int:
    base = V1 if V1.is_dir() else V2 if (V2 / "cgroup.procs").exists() else None
    if base is None or os.geteuid() != 0:
        print("suite_cpu: needs root and a cgroup v1 cpuacct or a cgroup v2 hierarchy", file=sys.stderr)
        return 2
    files = argv or sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/*/test_*.py"))
    rows = []
    for f in files:
        cg = base / f"layerline-suite-cpu-{os.getpid()}-{Path(f).stem}"
        cg.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        # the shell moves itself into the cgroup, then becomes pytest: everything it starts is counted
        r = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -m pytest -q -p no:cacheprovider "$1"',
                            sys.executable, f], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        time.sleep(1.0)   # daemons a test left to its finalizers end
        cpu = cpu_seconds(cg)
        rows.append((cpu, wall, r.returncode, f))
        print(f"{wall:8.1f} s wall {cpu:8.1f} s CPU  rc={r.returncode}  {f}", flush=True)
        try:
            cg.rmdir()
        except OSError:
            pass   # a process still in it: the cgroup stays until it ends
    print(f"\n{sum(w for _, w, _, _ in rows):.0f} s wall, {sum(c for c, _, _, _ in rows):.0f} s CPU over {len(rows)} files; "
          "the largest CPU:")
    for cpu, wall, _rc, f in sorted(rows, reverse=True)[:15]:
        print(f"{cpu:8.1f} s CPU {wall:8.1f} s wall  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
