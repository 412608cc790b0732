"""Turn a batch of results into a TensorDict for training code.

One row per sample (a job with ``n`` samples gives ``n`` rows, consecutive, sharing
``group``). Sequences are right-padded to the longest.

>>> td = results_to_tensordict(results)                           # doctest: +SKIP
>>> td["tokens"].shape, td["mask"].sum(-1) == td["lengths"]       # doctest: +SKIP

Keys: ``tokens`` [R, L] int64, ``logprobs`` [R, L] float32 (0 where absent), ``mask`` [R, L]
bool, ``lengths`` [R] int64, ``group`` [R] int64 (index of the job in ``results``),
``prompt_lengths`` [R] int64, ``policy_version_start`` / ``policy_version_end`` [R] int64,
``policy_version`` [R, L] int64 (the version that generated each token, from
:meth:`~rollq.protocol.Sample.token_versions`: it changes within a row where a ``keep``
weight update landed mid-generation; -1 where not known and in the padding),
``truncated`` [R] bool (finish reason ``length``). Failed jobs are skipped unless
``skip_errors=False``, which raises instead.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..protocol import Result
from ..protocol.results import successful


def results_to_tensordict(
    results: Sequence[Result], *, pad_token_id: int = 0, skip_errors: bool = True, layout: str = "rollq", **torchrl_kw: Any,
):  # noqa: ANN201
    """The layout above; ``layout="torchrl"``: TorchRL's LLM layout instead (``tokens.*``,
    ``log_probs.*``, ``masks.*``; :func:`rollq.torchrl.results_to_llm_tensordict`, which
    takes ``prompts=`` for token prompts)."""
    if layout == "torchrl":
        from ..torchrl.layout import results_to_llm_tensordict

        return results_to_llm_tensordict(results, skip_errors=skip_errors, **torchrl_kw)
    if layout != "rollq" or torchrl_kw:
        raise ValueError(f"layout must be 'rollq' or 'torchrl' (keyword arguments {sorted(torchrl_kw)} go with 'torchrl'), got {layout!r}")
    import torch
    from tensordict import TensorDict

    rows = []
    for gi, r in successful(results, skip_errors):
        for s in r.samples:
            ids = np.frombuffer(s.tokens, dtype="<i4")
            lp = np.frombuffer(s.logprobs, dtype="<f4") if s.logprobs else None
            rows.append((gi, r, s, ids, lp))
    n = len(rows)
    width = max((len(ids) for *_, ids, _ in rows), default=0)
    tokens = np.full((n, width), pad_token_id, dtype=np.int64)
    logprobs = np.zeros((n, width), dtype=np.float32)
    mask = np.zeros((n, width), dtype=bool)
    meta = np.zeros((n, 5), dtype=np.int64)  # lengths, group, prompt len, v_start, v_end
    truncated = np.zeros(n, dtype=bool)
    versions = np.full((n, width), -1, dtype=np.int64)
    for i, (gi, r, s, ids, lp) in enumerate(rows):
        k = len(ids)
        tokens[i, :k] = ids
        mask[i, :k] = True
        versions[i, :k] = s.token_versions(r.version_start) if s.versions else r.version_start
        if lp is not None:
            logprobs[i, : len(lp)] = lp
        meta[i] = (k, gi, r.prompt_tokens, r.version_start, r.version_end)
        truncated[i] = s.finish_reason == "length"
    return TensorDict(
        {
            "tokens": torch.from_numpy(tokens),
            "logprobs": torch.from_numpy(logprobs),
            "mask": torch.from_numpy(mask),
            "lengths": torch.from_numpy(meta[:, 0].copy()),
            "group": torch.from_numpy(meta[:, 1].copy()),
            "prompt_lengths": torch.from_numpy(meta[:, 2].copy()),
            "policy_version_start": torch.from_numpy(meta[:, 3].copy()),
            "policy_version_end": torch.from_numpy(meta[:, 4].copy()),
            "policy_version": torch.from_numpy(versions),
            "truncated": torch.from_numpy(truncated),
        },
        batch_size=[n],
    )
