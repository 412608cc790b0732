"""benchmarks/tp_slice.py, run tiny: the tiny model, two repetitions, its own temporary slot.

The script starts two worker processes and a gloo group of three on loopback; the test reads
the JSON and Markdown it writes: every way measured, cold and warm; each worker's weights
after every way bit-identical to the expected TP=2 slices (hashed against the trainer's own
slicing), so a way that mis-slices, skips a tensor or leaves zeros fails here; and the split
verification's partial checksums adding up to the whole tensors' (the script raises if not).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

BENCH = ROOT / "benchmarks" / "tp_slice.py"
MEMMAP_WAYS = ("whole+verify", "narrow", "narrow+split verify", "per-rank", "per-rank+verify", "per-rank pread")
BROADCAST_WAYS = ("broadcast whole", "send slices, staged", "send slices")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_slice")
    out = tmp / "tp_slice"
    cmd = [sys.executable, str(BENCH), "--models", "tiny", "--reps", "2", "--root", str(tmp / "slots"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert proc.returncode == 0, f"tp_slice failed ({proc.returncode}): {proc.stdout[-3000:]} {proc.stderr[-3000:]}"
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


def test_every_way_gives_bit_identical_worker_shards(report):
    data, _ = report
    (m,) = data["models"]
    want = {f"memmap {w} {c}" for w in MEMMAP_WAYS for c in ("cold", "warm")} | {f"broadcast {w}" for w in BROADCAST_WAYS}
    assert set(m["identical"]) == want
    assert all(m["identical"].values()), {k: v for k, v in m["identical"].items() if not v}


def test_split_checksums_add_up_to_the_whole_tensor_ones(report):
    data, _ = report
    (m,) = data["models"]
    # every cold and warm repetition: the two workers' partial sums gave the committed checksums
    assert m["split_checksums_matched"] == 2 * m["reps"] == 4


def test_report_is_complete(report):
    data, md = report
    assert set(data) >= {"command", "env", "args", "models"}
    (m,) = data["models"]
    assert m["model"] == "tiny" and m["dtype"] == "float32"
    # the tiny model's TP=2 parts: every tensor but the norms is split in two
    assert m["bytes_per_rank"] == (m["bytes_total"] + m["bytes_by_split_dim"]["None"]) // 2
    s = m["summary"]
    for way in MEMMAP_WAYS:
        for cache in ("cold", "warm"):
            r = s["memmap"][way][cache]
            assert r["wall_s"] > 0 and r["rep_wall_s"] >= r["wall_s"], (way, cache, r)
            assert len(m["raw"]["memmap"][way][cache]) == 2
        if not data["env"]["root_fs"].startswith("tmpfs"):  # tmpfs pages cannot be dropped
            assert s["memmap"][way]["cold"]["cached_before"] == 0  # the cold repetitions started uncached
        assert s["memmap"][way]["cold"]["page_cache_filled"] > 0
    for way in BROADCAST_WAYS:
        r = s["broadcast"][way]
        assert r["wall_s"] > 0 and r["trainer_wall_s"] > 0 and len(m["raw"]["broadcast"][way]) == 2
    whole, sliced = s["broadcast"]["broadcast whole"], s["broadcast"]["send slices"]
    staged = s["broadcast"]["send slices, staged"]
    assert whole["received_bytes"] == m["bytes_total"]
    assert sliced["received_bytes"] == staged["received_bytes"] == m["bytes_per_rank"]
    assert whole["sent_bytes"] == 2 * m["bytes_total"] and sliced["sent_bytes"] == staged["sent_bytes"] == 2 * m["bytes_per_rank"]
    assert whole["staging_bytes"] == staged["staging_bytes"] >= m["bytes_total"] and sliced["staging_bytes"] == 0
    assert sliced["trainer_copy_bytes"] == staged["trainer_copy_bytes"] == m["bytes_by_split_dim"]["1"] > 0
    assert len(m["ratios"]) == 12
    assert all(r["median"] > 0 and r["best"] > 0 for r in m["ratios"].values())
    assert "### memmap slot" in md and "### gloo broadcast" in md and "Command: `python" in md
    for way in MEMMAP_WAYS + BROADCAST_WAYS:
        assert f"| {way} |" in md
