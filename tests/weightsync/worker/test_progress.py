"""The requests' progress a swap reports (rollq.weightsync.worker._progress), read from a
model runner shaped as vLLM's second GPU runner (``req_states`` arrays)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from rollq.weightsync.worker._progress import RequestTracker


def _worker(computed: torch.Tensor, prompts: list[int]) -> Any:
    """A worker whose runner holds requests ``r0..`` at rows 0.. with ``prompts`` prompt
    tokens; ``computed``: the device's computed tokens per row (the host copy lags a step)."""
    states = SimpleNamespace(
        req_id_to_index={f"r{i}": i for i in range(len(prompts))},
        num_computed_tokens=SimpleNamespace(gpu=computed),
        num_computed_tokens_np=np.zeros(len(prompts), dtype=np.int32),
        prompt_len=SimpleNamespace(np=np.array(prompts, dtype=np.int32)),
    )
    return SimpleNamespace(model_runner=SimpleNamespace(req_states=states))


def test_a_report_begun_before_the_copies_counts_the_tokens_the_device_computed():
    """Each request's sampled tokens: ``computed - prompt + 1`` once its prompt is computed,
    0 before; the two-part report (begun, then finished) says what the one-part one says."""
    w = _worker(torch.tensor([10, 14, 3], dtype=torch.int32), [10, 10, 5])
    t = RequestTracker()
    assert t.report(w).tokens == {"r0": 1, "r1": 5, "r2": 0}
    assert t.begin_report(w)() == t.report(w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_report_begun_before_the_copies_waits_for_the_step_in_flight_not_for_the_copies():
    """On a GPU the report waits for the work enqueued before it (a step in flight, whose
    tokens it counts) and not for the swap's copies enqueued after it (a reader of the
    device's counts after the copies, as ``report`` alone is, waits for them too)."""
    computed = torch.tensor([10, 14], dtype=torch.int32, device="cuda")
    w = _worker(computed, [10, 10])
    t = RequestTracker()
    t.begin_report(w)()  # the pinned buffer, allocated once
    torch.cuda._sleep(50_000_000)  # the step in flight ...
    computed.add_(1)  # ... which computes one more token per request
    finish = t.begin_report(w)
    torch.cuda._sleep(2_000_000_000)  # the swap's copies, ~1 s on the device
    copies_end = torch.cuda.Event()
    copies_end.record()
    assert finish().tokens == {"r0": 2, "r1": 6}
    assert not copies_end.query(), "the report waited for the copies enqueued after it"
    torch.cuda.synchronize()


def test_a_report_leaves_out_requests_let_go_of_before_the_replicas_oldest_in_flight():
    """Requests vLLM let go of are reported for 30 s (an output may still be on its way), which
    at a GPU's request rate is thousands per swap. The replica says since when it waits for
    outputs (``since``): a report names only the requests let go of from then on, newest first,
    and with ``since`` 0 every remembered one."""
    import collections
    import time

    w = _worker(torch.tensor([12], dtype=torch.int32), [10])
    t = RequestTracker()
    now = time.time()
    t.removed = collections.OrderedDict(
        (f"old{i}", (4, time.monotonic(), now - 20 + i)) for i in range(3))  # let go of 18-20 s ago
    t.removed.update({"late": (7, time.monotonic(), now - 1.0)})
    t.since = now - 5.0
    assert t.report(w).tokens == {"r0": 3, "late": 7}
    t.since = 0.0
    assert t.report(w).tokens == {"r0": 3, "old0": 4, "old1": 4, "old2": 4, "late": 7}
