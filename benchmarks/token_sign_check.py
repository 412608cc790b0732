"""What does refusing negative prompt token ids cost a job's validation?

    python benchmarks/token_sign_check.py [--out benchmarks/results/token_sign_check]

``validate_job`` runs on every job twice (the producer when it submits, the consumer when it
pulls). It refuses negative ids by the sign bit of each little-endian int32: every fourth
byte of the packed ids, sliced out and tested with ``bytes.isascii`` (all below 0x80). Timed
side by side on prompts of 16, 512 and 8,192 tokens: the whole ``validate_job`` (sampling not
re-checked, as the consumer calls it), the sign check alone, and the obvious alternative
(``max`` over the sliced bytes), best of 5 repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def main() -> None:
    from rollq.protocol.jobs import make_job, validate_job

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/token_sign_check")
    a = ap.parse_args()
    rows = []
    for n in (16, 512, 8192):
        job = make_job(id="j", reply="p", prompt_token_ids=list(range(n)))
        tok = job.tokens
        rows.append({
            "tokens": n,
            "validate_job_us": round(best(lambda: validate_job(job, sampling=False), 20000) * 1e6, 3),
            "sign_check_isascii_us": round(best(lambda: not tok[3::4].isascii(), 20000) * 1e6, 3),
            "sign_check_max_us": round(best(lambda: max(tok[3::4]) >= 0x80, 2000) * 1e6, 3),
        })
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    lines = ["| prompt tokens | validate_job (us) | sign check, isascii (us) | sign check, max() (us) |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['tokens']} | {r['validate_job_us']} | {r['sign_check_isascii_us']} | {r['sign_check_max_us']} |" for r in rows]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
