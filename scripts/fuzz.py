"""Long-run fuzzing: random configurations against impl="reference", counting mismatches.

    PYTHONPATH=src python scripts/fuzz.py --impl torch --minutes 10
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/fuzz.py --impl triton --examples 50   # CPU
    PYTHONPATH=src python scripts/fuzz.py --impl triton --device cuda --minutes 10          # GPU
    PYTHONPATH=src python scripts/fuzz.py --varlen --impl torch --minutes 10   # packed documents

Draws cases from tests/property_cases.py (the same generator as the hypothesis tests; with
``--varlen`` packed documents from tests/varlen_cases.py, checked against the reference on each
document alone), checks forward, LSE and dq/dk/dv, prints each mismatch with its case
(replayable: the case holds its seed), a progress line every ``--every`` examples and a
summary; exit 1 if anything mismatched. The tensors are tiny: on a CPU set OMP_NUM_THREADS=1,
above all for several runs side by side (two runs of two threads each on two cores ran some
cases 20x slower, long enough to look hung).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from property_cases import check, random_case  # noqa: E402
from varlen_cases import check_varlen, random_varlen_case  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=["torch", "triton"], default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=int, default=0, help="stop after this many (0: no limit)")
    ap.add_argument("--minutes", type=float, default=1.0, help="stop after this long")
    ap.add_argument("--seed", type=int, default=None, help="generator seed (default: random)")
    ap.add_argument("--varlen", action="store_true", help="packed documents (dilated_attention_varlen)")
    ap.add_argument("--every", type=int, default=100, help="progress line every N examples")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    d = 16 if args.impl == "triton" else rng.choice([4, 16])
    draw, check_case = (random_varlen_case, check_varlen) if args.varlen else (random_case, check)
    what = "varlen" if args.varlen else "batch"
    print(f"fuzz ({what}): impl={args.impl} device={args.device} generator seed={seed}", flush=True)
    t0, n, mismatches, errors = time.monotonic(), 0, 0, 0
    while True:
        if args.examples and n >= args.examples:
            break
        if time.monotonic() - t0 > 60 * args.minutes:
            break
        case = draw(rng, d=d)
        n += 1
        try:
            bad = check_case(case, args.impl, args.device)
        except Exception as e:  # noqa: BLE001 - a crash is a finding too
            errors += 1
            print(f"ERROR {case}: {type(e).__name__}: {e}", flush=True)
            continue
        except KeyboardInterrupt:  # a case that seems to hang: say which one
            print(f"INTERRUPTED during {case} ({time.monotonic() - t0:.0f} s)", flush=True)
            raise
        if bad:
            mismatches += 1
            print(f"MISMATCH {case}: {'; '.join(bad)}", flush=True)
        if n % args.every == 0:
            print(f"... {n} examples, {mismatches} mismatches, {errors} errors, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    print(f"examples run: {n}  mismatches: {mismatches}  errors: {errors}  "
          f"({time.monotonic() - t0:.0f} s, generator seed {seed})")
    return 1 if (mismatches or errors) else 0


if __name__ == "__main__":
    raise SystemExit(main())
