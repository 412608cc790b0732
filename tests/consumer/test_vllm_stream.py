"""vLLM's DELTA outputs of a streamed job fold into the output FINAL_ONLY gives
(rollq/consumer/_vllm_stream.py), with fakes shaped as vLLM's RequestOutput: no vLLM needed."""

from __future__ import annotations

import struct
from types import SimpleNamespace

from rollq.consumer._vllm_api import to_output
from rollq.consumer._vllm_stream import DeltaFold
from rollq.protocol import SamplingParams, unpack_f32, unpack_i32


def f32(x: float) -> float:
    """``x`` rounded to float32, as results carry logprobs."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _lp(ids: list[int], base: float) -> list[dict[int, SimpleNamespace]]:
    """vLLM's per-position logprob dicts (the sampled token's entry, and another)."""
    return [{t: SimpleNamespace(logprob=base - k), t + 1: SimpleNamespace(logprob=-9.0)} for k, t in enumerate(ids)]


def _out(index: int, ids: list[int], text: str, base: float, finish: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(index=index, token_ids=ids, text=text, logprobs=_lp(ids, base), finish_reason=finish)


def test_deltas_fold_into_the_final_output_and_report_each_step():
    sp = SamplingParams(max_tokens=5, n=2, logprobs=0)
    steps = [  # n=2: each step holds only the samples that moved
        SimpleNamespace(outputs=[_out(0, [10], "a", -0.1)], prompt_token_ids=[1, 2], prompt_logprobs=None),
        SimpleNamespace(
            outputs=[_out(1, [20, 21], "xy", -0.2), _out(0, [11], "b", -0.3)], prompt_token_ids=[1, 2], prompt_logprobs=None
        ),
        SimpleNamespace(outputs=[_out(0, [12], "c", -0.4, "stop")], prompt_token_ids=[1, 2], prompt_logprobs=None),
        SimpleNamespace(outputs=[_out(1, [22], "z", -0.5, "length")], prompt_token_ids=[1, 2], prompt_logprobs=None),
    ]
    reported: list[tuple] = []
    fold = DeltaFold(lambda *a: reported.append(a), logprobs=True, detokenize=True)
    for s in steps:
        fold.add(s)
    out = to_output(fold.final(), sp, [1, 2], report_prompt=True)
    assert [s.token_ids for s in out.samples] == [[10, 11, 12], [20, 21, 22]]
    assert [s.text for s in out.samples] == ["abc", "xyz"]
    assert [s.finish_reason for s in out.samples] == ["stop", "length"]
    assert out.samples[1].token_logprobs == [f32(x) for x in (-0.2, -1.2, -0.5)]
    assert out.prompt_tokens == 2 and unpack_i32(out.prompt_ids) == [1, 2]
    # each step's new tokens, per sample, at their offsets
    got = [(j, off, unpack_i32(t), unpack_f32(lp), text) for j, off, t, lp, text in reported]
    assert got == [
        (0, 0, [10], [f32(-0.1)], "a"),
        (1, 0, [20, 21], [f32(-0.2), f32(-1.2)], "xy"),
        (0, 1, [11], [f32(-0.3)], "b"),
        (0, 2, [12], [f32(-0.4)], "c"),
        (1, 2, [22], [f32(-0.5)], "z"),
    ]


def test_nothing_came():
    assert DeltaFold(lambda *a: None, logprobs=False, detokenize=False).final() is None
