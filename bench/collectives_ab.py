#!/usr/bin/env python3
"""bench_collectives on each backend, alternating, several rounds: the "MPI against Gloo" table.

Each round runs build/bench/bench_collectives --json at W ranks once per variant, in this order:

    gloo           fsdprun --standalone --nproc-per-node W           (our algorithms on Gloo's TCP)
    mpi            mpirun -np W, as the project launches it            (OpenMPI's shared memory with
                                                                        single-copy where the kernel
                                                                        allows it)
    mpi_two_copy   mpirun -np W --mca btl_vader_single_copy_mechanism none
                                                                       (what a container that forbids
                                                                        cross-memory attach gets)
    mpi_before     as mpi_two_copy, with --baseline-build-dir's bench_collectives and libfsdp.so
                   (given only with that option)

and writes every JSON line to <out>/results.jsonl, the machine and command to <out>/meta.json,
and the table (median bus bandwidth over the rounds in GB/s, the median time, [min-max of the
bandwidth], and the median's ratio to gloo) to <out>/table.md.

    python3 bench/collectives_ab.py --out bench/results/collectives/DIR
    python3 bench/collectives_ab.py --out DIR --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import MPI_AS_ROOT, MPIRUN, REPO, TWO_COPY, fsdprun, git_commit, load_average, utc_now, write_text

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def variants(a) -> dict:
    bench = os.path.join(a.build_dir, "bench", "bench_collectives")
    args = ["--iters", str(a.iters), "--json", *(["--sizes-kib", a.sizes_kib] if a.sizes_kib else [])]
    mpirun = [*MPIRUN, "-np", str(a.world), "-x", "OMP_NUM_THREADS=1"]
    out = {
        "gloo": [*fsdprun(a.build_dir, a.world), bench, *args],
        "mpi": [*mpirun, bench, *args],
    }
    if not a.no_two_copy:
        out["mpi_two_copy"] = [*mpirun, *TWO_COPY, bench, *args]
    if a.baseline_build_dir:
        lib = os.path.join(a.baseline_build_dir, "src")
        out["mpi_before"] = [*mpirun, *TWO_COPY, "-x", f"LD_LIBRARY_PATH={lib}",
                             os.path.join(a.baseline_build_dir, "bench", "bench_collectives"), *args]
    return out


def json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.split("]:", 1)[1] if line.startswith("[rank") else line  # fsdprun's prefix
        if line.startswith("{"):
            # A baseline build from before bench_collectives wrote null printed nan there.
            rows.append(json.loads(line.replace(": nan", ": null")))
    return rows


def run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(MPI_AS_ROOT)
    cmds = variants(a)
    meta = {"command": " ".join([sys.executable, *sys.argv]), "variants": {k: " ".join(v) for k, v in cmds.items()},
            "date_utc": utc_now(), "load_average_before": load_average(), "commit": git_commit(),
            "world": a.world, "rounds": a.rounds, "iters": a.iters}
    with open(os.path.join(a.out, "results.jsonl"), "w") as fh:
        for k in range(1, a.rounds + 1):
            for name, cmd in cmds.items():
                r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
                rows = json_lines(r.stdout)
                print(f"[round {k}] {name}: rc={r.returncode}, {len(rows)} sizes", flush=True)
                for row in rows:
                    fh.write(json.dumps({"variant": name, "round": k, **row}) + "\n")
    meta["load_average_after"] = load_average()
    with open(os.path.join(a.out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)


def size_of(row: dict) -> int:
    return row.get("size_bytes") or row["size_mib"] << 20


def report(out: str) -> str:
    rows = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["| size | collective | " + " | ".join(names) + " | " +
             " | ".join(f"{n} / gloo" for n in names if n != "gloo") + " |",
             "|---|---|" + "---|" * (2 * len(names) - 1)]
    for size in sorted({size_of(r) for r in rows}):
        for kind in KINDS:
            med, cells = {}, []
            for n in names:
                mine = [r for r in rows if r["variant"] == n and size_of(r) == size]
                xs = [r[f"{kind}_busbw"] for r in mine]
                med[n] = statistics.median(xs)
                ms = statistics.median(r[f"{kind}_ms"] for r in mine)
                cells.append(f"{med[n]:.2f} ({ms:.3g} ms) [{min(xs):.2f}-{max(xs):.2f}]")
            ratios = [f"{med[n] / med['gloo']:.1f}x" for n in names if n != "gloo"]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            lines.append(f"| {label} | {kind.replace('_', '-')} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="bench_collectives --iters (default 20)")
    p.add_argument("--sizes-kib", default=None, help="bench_collectives --sizes-kib (default: its 1, 8, 64 MiB)")
    p.add_argument("--no-two-copy", action="store_true", help="leave out the mpi_two_copy variant")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--baseline-build-dir", default=None, help="another build, run as mpi_before")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    if not a.report_only:
        run(a)
    table = report(a.out)
    write_text(os.path.join(a.out, "table.md"), table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
