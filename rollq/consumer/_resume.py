"""Resume of partial rollouts across an ``abort`` weight update (``WeightSyncSettings.abort_resume``).

The ``abort`` policy ends every running request before it swaps new weights in. With
resume, each request's output so far is kept (the engine reports it with
``finish_reason="abort"``: vLLM's ``pause_generation(mode="abort")`` does, with every token
and logprob generated so far), and after the swap each sample that had not finished
continues on the new weights as a request of its own:

- prompt: the job's prompt token ids followed by the sample's partial tokens;
- ``n=1``, ``max_tokens`` (and ``min_tokens``) less the tokens already generated;
- the other sampling parameters as they were.

Samples that had finished keep their outputs. :func:`stitch` joins each partial sample and its
continuation into one sample (tokens, logprobs and text concatenated); the job's per-token
versions mark the resume as a swap after exactly the partial's tokens (see
:func:`~rollq.consumer._in_hand.mark_versions`), so the result reads as one sample whose
tokens up to the boundary come from the old version and the rest from the new one.

Limits, by design:

- a seeded job (``sampling.seed``) is not resumed but runs again from scratch: a
  continuation cannot reproduce the random stream the seed names, and a seeded result is
  meant to be reproducible;
- a stop string that would span the boundary (its start in the partial text, its end in the
  continuation) is not matched; stop token ids are;
- ``prompt_logprobs`` come from the first (old-version) run, over the original prompt.
"""

from __future__ import annotations

import msgspec

from ..protocol import Job, Sample, pack_i32, unpack_i32
from .engine import EngineOutput

#: The ``finish_reason`` of a sample the engine ended for a weight update.
ABORTED = "abort"


def resumable(job: Job, partial: EngineOutput | None) -> bool:
    """Whether ``job`` may continue from ``partial`` (its output when it was aborted) rather
    than run again from scratch: not seeded, and at least one sample was aborted."""
    if partial is None or job.sampling.seed is not None:
        return False
    return any(s.finish_reason == ABORTED for s in partial.samples)


def prompt_ids_of(job: Job, partial: EngineOutput) -> list[int] | None:
    """The job's prompt as token ids: a token prompt's own, else the engine's tokenization
    (``partial.prompt_ids``); None when neither is known."""
    if job.tokens is not None:
        return job.prompt_token_ids or []
    if partial.prompt_ids is not None:
        return unpack_i32(partial.prompt_ids)
    return None


def continuations(job: Job, prompt_ids: list[int], partial: EngineOutput) -> dict[int, Job]:
    """The request to run for each sample of ``partial`` that was aborted (sample index ->
    job): the prompt plus the sample's tokens, one sample, the tokens still to generate.
    A sample with ``max_tokens`` reached already is left out (it is complete)."""
    sp = job.sampling
    out: dict[int, Job] = {}
    for k, s in enumerate(partial.samples):
        if s.finish_reason != ABORTED:
            continue
        have = len(s.tokens) // 4
        left = sp.max_tokens - have
        if left <= 0:
            continue
        sampling = msgspec.structs.replace(sp, n=1, max_tokens=left, min_tokens=max(0, sp.min_tokens - have))
        out[k] = msgspec.structs.replace(
            job, text=None, messages=None, tokens=pack_i32([*prompt_ids, *s.token_ids]), sampling=sampling,
        )
    return out


def stitch(partial: EngineOutput, conts: dict[int, Sample]) -> EngineOutput:
    """``partial`` with each continued sample joined to its continuation ``conts[k]``; the
    other samples as they were (an aborted one whose ``max_tokens`` was reached ends with
    ``length``). Prompt fields are the partial run's.

    >>> from rollq.protocol import pack_f32
    >>> p = EngineOutput([Sample(pack_i32([1, 2]), pack_f32([-1.0, -2.0]), "ab", ABORTED)], 3)
    >>> out = stitch(p, {0: Sample(pack_i32([9]), pack_f32([-0.5]), "c", "stop")})
    >>> out.samples[0].token_ids, out.samples[0].token_logprobs, out.samples[0].text, out.samples[0].finish_reason
    ([1, 2, 9], [-1.0, -2.0, -0.5], 'abc', 'stop')
    """
    samples = []
    for k, s in enumerate(partial.samples):
        c = conts.get(k)
        if c is None:
            reason = "length" if s.finish_reason == ABORTED else s.finish_reason
            samples.append(msgspec.structs.replace(s, finish_reason=reason))
            continue
        lps = s.logprobs + c.logprobs if s.logprobs is not None and c.logprobs is not None else None
        text = s.text + c.text if s.text is not None and c.text is not None else None
        samples.append(Sample(
            tokens=s.tokens + c.tokens, logprobs=lps, text=text, finish_reason=c.finish_reason,
            lp_source=c.lp_source or s.lp_source,
        ))
    return EngineOutput(samples=samples, prompt_tokens=partial.prompt_tokens, prompt_ids=partial.prompt_ids,
                        prompt_logprobs=partial.prompt_logprobs)
