"""Pairwise p2p calibration on local gloo ranks: how well the fit holds on this machine, now.

The unit tests check the fit on exact synthetic transfers (tests/distributed/profiler/test_calibration.py,
tests/unit/cli/test_cli_topology.py); whether a real ping-pong on a loaded CPU box gives a bandwidth term
at all (the 8 MiB transfer must dwarf the noise) is a measurement, made here: each round runs
``profiler.pairwise.calibrate_pairwise`` on ``--nproc`` ranks and records, per pair, the fitted
bandwidth and latency and their mean relative error, or why no fit was possible.

    python scripts/bench_calibration.py                      # 3 rounds, 3 ranks, 64 KiB and 8 MiB
    python scripts/bench_calibration.py --rounds 1 --nproc 2 --sizes-kib 64 1024
"""

from __future__ import annotations

import argparse
import time

from nest_fx.cluster import load_cluster
from profiler.collectives import CalibrationError
from profiler.pairwise import calibrate_pairwise

from _bench_common import environment_line, print_table, write_json


def one_round(nproc: int, sizes_kib, repeats: int, base_spec: str) -> dict:
    """One calibration: per-pair fits, or the error that stopped it."""
    base = load_cluster(base_spec).topology
    start = time.perf_counter()
    try:
        _, fits, samples = calibrate_pairwise(
            nproc=nproc, sizes=[s * 1024 for s in sizes_kib], base=base, repeats=repeats
        )
    except (CalibrationError, ValueError) as exc:
        return {"ok": False, "error": str(exc), "seconds": time.perf_counter() - start}
    return {
        "ok": True,
        "seconds": time.perf_counter() - start,
        "samples": len(samples),
        "pairs": [
            {"pair": [f.src, f.dst], "bandwidth": f.bandwidth, "latency": f.latency, "mean_abs_error": f.mean_abs_error}
            for f in fits
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--base", default="fat-tree:1x4,device=cpu-gloo", help="the topology the measured ranks derate")
    ap.add_argument("--out", default="results/bench_calibration.json")
    args = ap.parse_args()
    print(environment_line())
    rounds = [one_round(args.nproc, args.sizes_kib, args.repeats, args.base) for _ in range(args.rounds)]
    rows = []
    for k, r in enumerate(rounds):
        if not r["ok"]:
            rows.append([k, "-", "-", "-", f"no fit: {r['error'][:80]}"])
            continue
        for p in r["pairs"]:
            rows.append(
                [
                    k,
                    f"{p['pair'][0]} - {p['pair'][1]}",
                    f"{p['bandwidth'] / 1e9:.2f}",
                    f"{p['latency'] * 1e6:.0f}",
                    f"{100 * p['mean_abs_error']:.1f}%",
                ]
            )
    print_table(rows, headers=["round", "pair", "GB/s", "latency us", "mean error"])
    fitted = sum(r["ok"] for r in rounds)
    print(f"a bandwidth term fitted in {fitted}/{len(rounds)} rounds")
    write_json(
        args.out,
        {
            "nproc": args.nproc,
            "sizes_kib": args.sizes_kib,
            "repeats": args.repeats,
            "base": args.base,
            "rounds": rounds,
            "fitted_rounds": fitted,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
