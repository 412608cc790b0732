"""For TorchRL users: ``generate()`` shaped like ``AsyncVLLM.generate``, through the queue.

>>> llm = RollqLLM("redis://127.0.0.1:6379/0", queue="grpo")                    # doctest: +SKIP
>>> out = llm.generate(["1+1=", "2+2="], {"max_tokens": 8, "temperature": 0})  # doctest: +SKIP
>>> out[0].outputs[0].token_ids, out[0].policy_version                          # doctest: +SKIP

Differences from TorchRL, on purpose: there is no ``actor_index`` load balancer (replicas pull;
pass ``replica=`` to pin a follow-up turn); ``timeout_seconds`` cancels the job, which aborts
its vLLM request on the replica; each output also carries ``policy_version``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import InvalidJob
from ..protocol import Result, SamplingParams, cut, prompt_parts
from .sync import SyncProducer

#: Fields of ``vllm.SamplingParams`` that do not change what a replica returns here: how
#: vLLM streams or lays out its outputs (rollq returns each job once, finished), and
#: values vLLM derives from other fields.
_NO_EFFECT = frozenset({"output_kind", "stream_interval", "skip_clone", "flat_logprobs", "output_text_buffer_length"})
#: vLLM returns the top-k alternatives for ``logprobs=k``; a rollq result carries the logprob
#: of the sampled (or given) token only, which is what ``logprobs`` 0 and 1 ask for.
_MAX_VLLM_LOGPROBS = 1

@dataclass
class CompletionOutput:
    """Mirrors ``vllm.CompletionOutput`` (the fields RL code reads)."""

    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each generated token
    finish_reason: str | None
    #: The policy version that generated each token (see ``Sample.token_versions``).
    token_versions: list[int] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass
class RequestOutput:
    """Mirrors ``vllm.RequestOutput``, plus the policy version span and the replica."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    policy_version: tuple[int, int] = (0, 0)
    replica: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    #: ``sampling_params.prompt_logprobs``: each prompt token's logprob (the first: None).
    prompt_logprobs: list[float | None] | None = None

    @classmethod
    def from_result(cls, r: Result, prompt: str | None = None, prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """``prompt_token_ids``: the caller's token prompt; text and chat prompts take the ids
        the replica tokenized."""
        return cls(
            request_id=r.id, prompt=prompt,
            prompt_token_ids=prompt_token_ids if prompt_token_ids is not None else r.prompt_token_ids,
            outputs=[
                CompletionOutput(i, s.text, s.token_ids, s.token_logprobs, s.finish_reason, s.token_versions(r.version_start))
                for i, s in enumerate(r.samples)
            ],
            policy_version=r.policy_version, replica=r.replica,
            metrics={"queued_s": r.queued_s, "run_s": max(0.0, r.finished - r.started)},
            prompt_logprobs=r.prompt_logprobs,
        )


def sampling_to_dict(sp: Any) -> dict[str, Any] | None:
    """A job's ``sampling`` from a dict, a rollq :class:`~rollq.protocol.SamplingParams` or a
    ``vllm.SamplingParams``.

    Every field of a ``vllm.SamplingParams`` that differs from vLLM's default is carried to
    the replica, or refused with :class:`~rollq.errors.InvalidJob` naming it: never dropped.

    >>> sampling_to_dict({"max_tokens": 4})
    {'max_tokens': 4}
    """
    if sp is None or isinstance(sp, dict):
        return sp
    if isinstance(sp, SamplingParams):
        return sp.to_dict()
    fields = getattr(type(sp), "__struct_fields__", None)
    if fields is None:
        raise InvalidJob(f"sampling params must be a dict, rollq.SamplingParams or vllm.SamplingParams, got {type(sp).__name__}")
    default = type(sp)()
    out: dict[str, Any] = {}
    for name in SamplingParams.__struct_fields__:
        v = getattr(sp, name, None)
        if name in fields and v != getattr(default, name):
            if name in ("logprobs", "prompt_logprobs") and v is not None and v > _MAX_VLLM_LOGPROBS:
                raise InvalidJob(
                    f"sampling_params.{name}={v}: rollq returns the logprob of the sampled (or given) token "
                    f"only, not the top-{v} alternatives; use {name}=0 or 1"
                )
            out[name] = list(v) if isinstance(v, (list, tuple, set)) else v
    # What vLLM derives from the carried fields (it derives the same on the replica); any
    # other difference is a field rollq does not carry.
    derived = type(sp)(**out)
    refused = [
        f"{name}={cut(repr(getattr(sp, name)), 60)}"
        for name in fields
        if not name.startswith("_") and name not in _NO_EFFECT and name not in out
        and getattr(sp, name) != getattr(derived, name)
    ]
    if out.get("top_k") == -1:
        out["top_k"] = 0
    if refused:
        raise InvalidJob(
            f"sampling_params field(s) rollq replicas do not apply: {', '.join(refused)} "
            f"(supported: {', '.join(sorted(SamplingParams.__struct_fields__))})"
        )
    return out


def _is_batch(prompts: Any, prompt_token_ids: Any) -> bool:
    """A batch, or one prompt? A list of ints is one token prompt (as vLLM reads it); a
    list of anything else is a batch."""
    if prompt_token_ids is not None:
        return bool(prompt_token_ids) and isinstance(prompt_token_ids[0], (list, tuple))
    if isinstance(prompts, (list, tuple)):
        return not (prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts))
    return False


class RollqLLM:
    """A blocking client with the shape of TorchRL's ``AsyncVLLM.generate``."""

    def __init__(self, url: str | None = None, queue: str = "default", **producer_kwargs: Any):
        self._p = SyncProducer(url, queue, **producer_kwargs)

    @property
    def producer(self) -> SyncProducer:
        """The blocking producer that jobs go through."""
        return self._p

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
        timeout_seconds: float | None = None,
        replica: str | None = None,
        min_version: int | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a batch; blocks until every result is in.

        A prompt is a ``str``, a ``TokensPrompt`` dict (``{"prompt_token_ids": [...]}``), a
        ``TextPrompt`` dict or a list of token ids; a list of prompts is a batch. Any other
        type raises :class:`~rollq.errors.InvalidJob`, and so does a ``vllm.SamplingParams``
        field that replicas would not apply (see :func:`sampling_to_dict`).
        ``sampling_params`` with ``prompt_logprobs`` fills each output's ``prompt_logprobs``.

        A failed job raises its :class:`~rollq.errors.JobError`; a timeout cancels what is
        still running (aborting the vLLM requests) and raises ``TimeoutError``.
        """
        batch, done = self.run(prompts, sampling_params, prompt_token_ids=prompt_token_ids,
                               timeout_seconds=timeout_seconds, replica=replica, min_version=min_version)
        outs = [RequestOutput.from_result(r, text, ids) for r, text, ids in done]
        return outs if batch else outs[0]

    def run(
        self,
        prompts: Any,
        sampling_params: Any,
        *,
        prompt_token_ids: Any = None,
        timeout_seconds: float | None = None,
        replica: str | None = None,
        min_version: int | None = None,
    ) -> tuple[bool, list[tuple[Result, str | None, list[int] | None]]]:
        """What :meth:`generate` does, returning ``(batch?, [(result, text prompt, token
        prompt), ...])`` in prompt order, for adapters that build their own output types."""
        if prompts is None and prompt_token_ids is None:
            raise InvalidJob("generate() needs prompts or prompt_token_ids")
        batch = _is_batch(prompts, prompt_token_ids)
        sampling = sampling_to_dict(sampling_params)
        if prompt_token_ids is not None:
            ids_list = list(prompt_token_ids) if batch else [prompt_token_ids]
            specs = [{"prompt_token_ids": list(ids)} for ids in ids_list]
            texts: list[str | None] = [None] * len(specs)
        else:
            given = list(prompts) if batch else [prompts]
            texts, ids_list = [], []
            for p in given:  # str, TokensPrompt dict, TextPrompt dict or a list of token ids
                text, ids = prompt_parts(p)
                texts.append(text)
                ids_list.append(ids)
            specs = [{"prompt": t} if t is not None else {"prompt_token_ids": ids} for t, ids in zip(texts, ids_list)]
        for s in specs:
            s["sampling"] = sampling
            if replica:
                s["replica"] = replica
            if min_version is not None:
                s["min_version"] = min_version
        handles = self._p.submit_many(specs)
        done = []
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        try:
            for h, text, ids in zip(handles, texts, ids_list):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done.append((h.result(timeout=left), text, list(ids) if ids is not None else None))
        except TimeoutError:
            for h in handles:
                if not h.done():
                    h.cancel()
            raise TimeoutError(
                f"generate() timed out after {timeout_seconds}s (timeout_seconds); unfinished jobs were cancelled"
            ) from None
        return batch, done

    def close(self) -> None:
        self._p.close()

    def __enter__(self) -> RollqLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
