"""The behavior policy as the trainer sees it: which version made a sample
(:func:`single_version`), which transform its logprobs hold (:func:`behavior_temperature`,
:class:`SamplingTransformError`), the trainer's logprobs of the same tokens
(:func:`token_logprobs`) and how far the two are apart (:func:`logprob_agreement`).

:func:`logprob_agreement` is the end-to-end check of weight sync: the replica's behavior
logprobs of samples generated entirely at version ``v`` must equal the trainer's logprobs at
``v`` to float tolerance; a mis-loaded tensor shows up there first.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = [
    "SamplingTransformError",
    "agreement_terms",
    "behavior_temperature",
    "diff_by_confidence",
    "diff_terms",
    "logprob_agreement",
    "single_version",
    "token_logprobs",
]


# ----------------------------------------------------------------------------------------
# Versions of samples
# ----------------------------------------------------------------------------------------
def single_version(result: Any) -> int | None:
    """The policy version that generated every token of ``result``, or None if several did.

    The one place that decides "entirely at version v": from the per-token versions of its
    samples (:meth:`rollq.protocol.Sample.single_version`), so a result whose span is
    ``(3, 4)`` but whose every token came before version 4 was swapped in counts as version 3.

    >>> from rollq.protocol import Result, Sample, pack_i32
    >>> one = Sample(tokens=pack_i32([5, 6]), versions=[(3, 0), (4, 2)])   # 4 began after the last token
    >>> two = Sample(tokens=pack_i32([5, 6]), versions=[(3, 0), (4, 1)])
    >>> single_version(Result(id="j", version_start=3, version_end=4, samples=[one]))
    3
    >>> single_version(Result(id="j", version_start=3, version_end=4, samples=[one, two])) is None
    True
    """
    if result.version_start == result.version_end:
        return result.version_start
    if not result.samples or any(s.versions is None for s in result.samples):
        return None  # a span without per-token marks: which tokens came from which is unknown
    got = {s.single_version(result.version_start) for s in result.samples}
    return got.pop() if len(got) == 1 else None


# ----------------------------------------------------------------------------------------
# What the behavior logprobs are
# ----------------------------------------------------------------------------------------
class SamplingTransformError(ValueError):
    """A result's behavior logprobs are not the probabilities its tokens were sampled from,
    and the trainer cannot compute the same ones: the message starts with the field."""


#: Temperatures below this are greedy in vLLM (its ``_SAMPLING_EPS``).
_GREEDY_BELOW = 1e-5


def behavior_temperature(result: Any) -> float:
    """The temperature ``T`` at which the trainer's ``log_softmax(logits / T)`` is the
    distribution of ``result``'s behavior logprobs; raises :class:`SamplingTransformError`
    naming the field where no such ``T`` exists.

    >>> from rollq.protocol import LogprobSource, Result, Sample, SamplingParams, pack_i32
    >>> def res(kind, **sp):
    ...     src = LogprobSource.of(SamplingParams(ignore_eos=True, **sp), kind)
    ...     return Result(id="j", samples=[Sample(tokens=pack_i32([5]), lp_source=src)])
    >>> behavior_temperature(res("processed", temperature=0.7))
    0.7
    >>> behavior_temperature(res("raw", temperature=0.7))
    Traceback (most recent call last):
    ...
    rollq.rl.behavior.SamplingTransformError: temperature=0.7: job 'j' holds vLLM's raw logprobs ...
    >>> behavior_temperature(res("processed", top_p=0.9))
    Traceback (most recent call last):
    ...
    rollq.rl.behavior.SamplingTransformError: top_p=0.9: the trainer cannot apply the same transform; ...
    """
    temps = {_sample_temperature(result.id, s.logprob_source) for s in result.samples}
    if len(temps) > 1:
        raise SamplingTransformError(f"temperature: the samples of job {result.id!r} were drawn at {sorted(temps)}")
    return temps.pop() if temps else 1.0


def _sample_temperature(job_id: str, src: Any) -> float:
    if src.temperature < _GREEDY_BELOW:
        raise SamplingTransformError(
            f"temperature={src.temperature!r}: job {job_id!r} was sampled greedily, which has no "
            "distribution to take a ratio with; sample at a temperature > 0")
    changed = src.transformed()
    if src.kind == "raw":
        if changed:
            raise SamplingTransformError(
                f"{changed[0]}: job {job_id!r} holds vLLM's raw logprobs (of the logits before "
                "the sampling transform), not the probabilities its tokens were sampled from; serve it "
                "from a replica with VllmEngineConfig(logprobs_mode='processed_logprobs'), or sample "
                "at temperature 1 with no top-p, top-k, min-p or penalties")
        return 1.0
    beyond = [c for c in changed if not c.startswith("temperature=")]
    if beyond:
        raise SamplingTransformError(
            f"{beyond[0]}: the trainer cannot apply the same transform; job {job_id!r} must be "
            "sampled with it at its neutral value (the trainer reproduces the temperature only)")
    return float(src.temperature)


# ----------------------------------------------------------------------------------------
# Logprobs of given tokens
# ----------------------------------------------------------------------------------------
class _PickedLogprobs(torch.nn.Module):
    """Logprobs of chosen tokens at chosen positions: the decoder runs on the whole batch, the
    LM head only on the positions that predict completion tokens (the head's matmul and its
    backward are most of the cost otherwise). A module, so ``functional_call`` can swap in
    the weights of another version (parameter names: ``lm.`` + the model's)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def decoder(self) -> torch.nn.Module:
        return self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model

    def head(self, h: torch.Tensor, tok: torch.Tensor, temp: torch.Tensor | None) -> torch.Tensor:
        logits = self.lm.get_output_embeddings()(h).float()
        if temp is not None:  # per row, in float32, as vLLM's sampler divides
            logits = logits / temp.view(-1, 1, 1)
        return torch.log_softmax(logits, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor, temp: torch.Tensor | None
    ) -> torch.Tensor:
        hidden = self.decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
        return self.head(hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), tok, temp)


class _SharedPromptLogprobs(_PickedLogprobs):
    """The same logprobs for rows that share prompts (a GRPO group's samples): each distinct
    prompt but its last token runs through the decoder once, its key/value cache is gathered
    to every row of that prompt (``index_select``: gradients flow back to the one prompt pass),
    and each row runs on from there with ``[last prompt token] + completion[:-1]``, whose
    outputs predict the completion's tokens. Causal attention makes this the same computation
    as the whole sequence per row; a group of ``n`` samples pays for its prompt once, not ``n``
    times. Rows here share one prompt length (``ctx``: ``[distinct prompts, length - 1]``)."""

    def forward(  # type: ignore[override]
        self, ctx: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor, tok: torch.Tensor,
        temp: torch.Tensor | None,
    ) -> torch.Tensor:
        dec = self.decoder()
        if ctx.shape[1] == 0:  # one-token prompts: nothing to share
            return self.head(dec(input_ids=ids, attention_mask=attn).last_hidden_state, tok, temp)
        cache = dec(input_ids=ctx, use_cache=True).past_key_values
        cache.reorder_cache(rows)
        full = torch.cat([torch.ones(ids.shape[0], ctx.shape[1], dtype=attn.dtype, device=attn.device), attn], dim=1)
        hidden = dec(input_ids=ids, attention_mask=full, past_key_values=cache, use_cache=True).last_hidden_state
        return self.head(hidden, tok, temp)


def token_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    state: Mapping[str, torch.Tensor] | None = None,
    temperature: float | Sequence[float] = 1.0,
    *,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each completion's tokens after its prompt, in one right-padded batch.

    Returns ``(logp, mask)``, both ``[len(completions), longest completion]`` (float32).
    With ``state`` the model is evaluated at those weights (``torch.func.functional_call``)
    instead of its own. ``temperature`` (one, or one per completion): the logprobs are
    ``log_softmax(logits / T)``, those of sampling at ``T``. Gradients flow unless called
    under ``torch.no_grad()``. Where prompts repeat (``share_prompts``, a GRPO group's ``n``
    samples of one prompt) each distinct prompt runs through the decoder once and its rows
    continue from its key/value cache (the model must take ``past_key_values``, as
    transformers' causal LMs do); ``share_prompts=False`` runs every row whole. The two agree
    to float rounding.

    >>> logp, mask = token_logprobs(model, [[5, 6, 7]], [[100, 200]])   # doctest: +SKIP
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    n = len(prompts)
    longest = max((len(c) for c in completions), default=0)
    width = max(1, longest)
    tok, filled = _right_padded(completions, width)
    mask = filled.bool()
    temps = [float(temperature)] * n if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if len(temps) != n:
        raise ValueError(f"{len(temps)} temperatures for {n} completions")
    dev = next(model.parameters()).device
    temp = None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32, device=dev)
    weights = None if state is None else {f"lm.{k}": v for k, v in state.items()}

    def run(picker: torch.nn.Module, *args: Any) -> torch.Tensor:
        return picker(*args) if weights is None else torch.func.functional_call(picker, weights, args)

    if share_prompts and len({tuple(p) for p in prompts}) < n:
        logp = _shared_prompt_pass(_SharedPromptLogprobs(model), run, prompts, completions, tok, temp, dev)
    else:
        logp = run(_PickedLogprobs(model), *_whole_rows(prompts, completions, width, dev), tok.to(dev), temp)
    mask = mask.to(dev)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    return logp[:, :longest], mask[:, :longest]


def _right_padded(seqs: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)`` of ``seqs``, right-padded to ``width``."""
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attn[i, : len(seq)] = 1
    return ids, attn


def _whole_rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], width: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, attention mask, positions)`` of prompt + completion per row, right-padded; the
    position predicting completion token j is ``len(prompt) + j - 1`` (padding: any valid one);
    ``width`` positions per row."""
    ids, attn = _right_padded([[*p, *c] for p, c in zip(prompts, completions)],
                              max(len(p) + len(c) for p, c in zip(prompts, completions)))
    pos = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        pos[i] = len(p) - 1
        pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
    return ids.to(dev), attn.to(dev), pos.to(dev)


def _shared_prompt_pass(
    picker: _SharedPromptLogprobs, run: Callable[..., torch.Tensor], prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
    tok: torch.Tensor, temp: torch.Tensor | None, dev: torch.device,
) -> torch.Tensor:
    """:class:`_SharedPromptLogprobs` over the rows, one pass per prompt length, back in row order."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    width = tok.shape[1]
    parts, order = [], []
    for plen, idx in by_len.items():
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(prompts[i]), len(distinct)) for i in idx]
        ctx = torch.tensor([list(p[:-1]) for p in distinct], dtype=torch.long).view(len(distinct), plen - 1)
        ids, attn = _right_padded([[prompts[i][-1], *list(completions[i])[:-1]] for i in idx], width)
        sel = torch.tensor(idx, dtype=torch.long)
        parts.append(run(picker, ctx.to(dev), torch.tensor(rows, device=dev), ids.to(dev), attn.to(dev),
                         tok[sel].to(dev), None if temp is None else temp[sel.to(dev)]))
        order += idx
    if len(parts) == 1 and order == list(range(len(order))):
        return parts[0]
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts)[back.to(dev)]


def _behavior(results: Sequence[Any]) -> tuple[list[list[float]], list[float]]:
    """The behavior logprobs of every sample of ``results`` and the temperature of each
    (:func:`behavior_temperature`; raises :class:`SamplingTransformError`)."""
    out, temps = [], []
    for r in results:
        t = behavior_temperature(r)
        for s in r.samples:
            lp = s.token_logprobs
            if lp is None or len(lp) != len(s.tokens) // 4:
                raise ValueError(f"job {r.id!r}: samples need per-token logprobs (submit with sampling logprobs=0)")
            out.append(lp)
            temps.append(t)
    return out, temps


def logprob_agreement(
    model: torch.nn.Module,
    results: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    state: Mapping[str, torch.Tensor] | None = None,
) -> tuple[float, float, int]:
    """Mean and max absolute difference between the replica's behavior logprobs and the
    trainer's logprobs of the same tokens, and the number of tokens compared.

    ``results[i]`` was generated from ``prompts[i]`` at the version whose weights are the
    model's (or ``state``). Callers pass only results generated entirely at that version
    (:func:`single_version`). The trainer's logprobs are taken at each result's
    :func:`behavior_temperature` (a result whose transform it cannot apply raises
    :class:`SamplingTransformError`). Float32 on CPU agrees to ~1e-6 per token on the tiny
    model; a stale or mis-loaded tensor gives differences of order 0.1 or more.

    >>> mean, worst, n = logprob_agreement(model, results, prompts)   # doctest: +SKIP
    """
    d, _ = agreement_terms(model, results, prompts, state)
    if d.numel() == 0:
        return 0.0, 0.0, 0
    return float(d.mean()), float(d.max()), int(d.numel())


def agreement_terms(
    model: torch.nn.Module,
    results: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    state: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token terms behind :func:`logprob_agreement`: ``|behavior - trainer|`` of every
    compared token and the behavior logprob of each (flat tensors of one length), for figures
    that split the agreement, e.g. :func:`diff_by_confidence`."""
    rows = [(prompts[i], s.token_ids) for i, r in enumerate(results) for s in r.samples]
    if not rows:
        return torch.zeros(0), torch.zeros(0)
    behavior, temps = _behavior(results)
    with torch.no_grad():
        logp, mask = token_logprobs(model, [p for p, _ in rows], [c for _, c in rows], state, temps)
    return diff_terms(logp, _padded(behavior, logp), mask)


def diff_terms(logp: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|behavior - trainer|, behavior logprob)`` of the tokens where ``mask`` is set (flat;
    ``logp`` may be narrower than the other two: they are cut to its width).

    >>> d, b = diff_terms(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0, 0.0]]), torch.tensor([[True, False, True]]))
    >>> d.tolist(), b.tolist()
    ([0.5], [-1.5])
    """
    w = logp.shape[1]
    b, m = behavior[:, :w], mask[:, :w]
    return (logp.detach() - b).abs()[m], b[m]


#: :func:`diff_by_confidence`'s buckets: the behavior probability of the sampled token.
CONFIDENCE_BUCKETS = (("p>=0.9", 0.9, 1.01), ("0.5<=p<0.9", 0.5, 0.9), ("p<0.5", 0.0, 0.5))


def diff_by_confidence(diff: torch.Tensor, behavior: torch.Tensor) -> dict[str, list[float]]:
    """``{bucket: [sum, max, tokens]}`` of ``diff`` by the behavior probability of each token
    (:data:`CONFIDENCE_BUCKETS`). Rounding errors in logprobs grow as a token's probability
    falls, and a policy that turned near-deterministic agrees almost exactly whatever the
    kernels, so runs whose policies differ in confidence compare bucket by bucket.

    >>> d = diff_by_confidence(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([-0.01, -2.0, -3.0]))
    >>> d["p>=0.9"], d["p<0.5"][2]
    ([0.10000000149011612, 0.10000000149011612, 1], 2)
    """
    p = behavior.exp()
    out: dict[str, list[float]] = {}
    for name, lo, hi in CONFIDENCE_BUCKETS:
        sel = (p >= lo) & (p < hi)
        k = int(sel.sum())
        if k:
            out[name] = [float(diff[sel].sum()), float(diff[sel].max()), k]
    return out


def merge_buckets(into: dict[str, list[float]], more: dict[str, list[float]]) -> dict[str, list[float]]:
    """``into`` with ``more`` added (``[sum, max, tokens]`` per bucket), in place.

    >>> merge_buckets({"a": [1.0, 0.5, 2]}, {"a": [2.0, 0.7, 3], "b": [1.0, 1.0, 1]})
    {'a': [3.0, 0.7, 5], 'b': [1.0, 1.0, 1]}
    """
    for k, (dsum, dmax, n) in more.items():
        acc = into.setdefault(k, [0.0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + dsum, max(acc[1], dmax), acc[2] + n
    return into


def _padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.shape, dtype=like.dtype)
    for i, lp in enumerate(rows):
        out[i, : len(lp)] = torch.tensor(lp, dtype=like.dtype)
    return out.to(like.device)
