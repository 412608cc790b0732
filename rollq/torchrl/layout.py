"""rollq results in TorchRL's LLM layout, the keys ``vLLMWrapper`` writes and TorchRL's
losses (``GRPOLoss``, ``SFTLoss``) read.

One row per sample (a job with ``n`` samples gives ``n`` consecutive rows). Rows are
ragged (TorchRL's ``pad_output=False`` layout: a lazy stack; read padded with
``td.get(key, as_padded_tensor=True, padding_side=...)``):

- ``tokens``: ``prompt``, ``response``, ``full`` (prompt + response), int64
- ``log_probs``: ``response`` (the replica's behaviour logprobs; NaN where the job asked for
  none), ``full`` (prompt + response: the prompt logprobs when the job asked for them, else
  NaN over the prompt), ``prompt`` (only with prompt logprobs). NaN is TorchRL's alignment
  pad (its ``vLLMWrapper`` fills the prompt slice of ``full`` so when the engine gave no
  prompt scores): ``GRPOLoss`` keeps non-finite positions out of the importance ratio, with
  any ``masking_strategy``, where 0.0 would count as a logprob of 1. A prompt position
  without a score (the first) is NaN too.
- ``masks``: ``all_attention_mask`` (all True), ``all_assistant_mask`` (the response), over ``full``
- ``text``: ``prompt`` / ``response`` where the replica detokenized
- rollq's own: ``policy_version`` (per response token, -1: not known exactly),
  ``policy_version_start``, ``policy_version_end``, ``group`` (index of the result)

>>> td = results_to_llm_tensordict(results, prompts=prompt_ids)        # doctest: +SKIP
>>> td.get(("tokens", "full"), as_padded_tensor=True, padding_side="left").shape  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Sequence

from ..errors import InvalidJob
from ..protocol import Result
from ..protocol.results import successful


def results_to_llm_tensordict(
    results: Sequence[Result],
    *,
    prompts: Sequence[Sequence[int] | None] | None = None,
    texts: Sequence[str | None] | None = None,
    skip_errors: bool = True,
):  # noqa: ANN201
    """``results`` (and, for token prompts, their ``prompts`` ids, in the same order) as a
    TensorDict in TorchRL's LLM layout (see the module docstring). Failed jobs are skipped
    unless ``skip_errors=False``, which raises their error."""
    import torch
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm.policies import LogProbs, Masks, Text, Tokens

    rows = []
    for gi, r in successful(results, skip_errors):
        given = prompts[gi] if prompts is not None else None
        ids = list(given) if given is not None else r.prompt_token_ids
        if ids is None:
            raise InvalidJob(f"result {r.id}: a token prompt's ids are not in its result; pass prompts=")
        prompt = torch.tensor(ids, dtype=torch.int64)
        plp = r.prompt_logprobs
        nan = float("nan")
        prompt_lp = None if plp is None else torch.tensor([nan if x is None else x for x in plp], dtype=torch.float32)
        prompt_pad = prompt_lp if prompt_lp is not None else torch.full((len(prompt),), nan)
        prompt_text = texts[gi] if texts is not None else None
        for s in r.samples:
            response = torch.tensor(s.token_ids, dtype=torch.int64)
            lps = s.token_logprobs
            resp_lp = torch.tensor(lps, dtype=torch.float32) if lps is not None else torch.full((len(response),), nan)
            full_lp = torch.cat([prompt_pad, resp_lp])
            assistant = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(response), dtype=torch.bool)])
            rows.append(TensorDict(
                tokens=Tokens(prompt=prompt, response=response, full=torch.cat([prompt, response]), padded=False),
                log_probs=LogProbs(prompt=prompt_lp, response=resp_lp, full=full_lp, padded=False),
                masks=Masks(all_attention_mask=torch.ones(len(assistant), dtype=torch.bool),
                            all_assistant_mask=assistant, padded=False),
                text=Text(prompt=prompt_text, response=s.text,
                          full=None if prompt_text is None or s.text is None else prompt_text + s.text),
                policy_version=torch.tensor(s.token_versions(r.version_start), dtype=torch.int64),
                policy_version_start=torch.tensor(r.version_start), policy_version_end=torch.tensor(r.version_end),
                group=torch.tensor(gi),
            ))
    if not rows:
        raise InvalidJob("no successful results to lay out")
    return lazy_stack(rows)
