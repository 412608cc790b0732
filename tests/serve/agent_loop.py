"""A multi-turn agent loop over chat completions with a tool-like environment, as an RL agent
harness runs it against ``rollq serve`` with the ``openai`` SDK, and what its trainer checks.

Each episode alternates a model turn (a chat completion with ``return_token_ids``) and a tool
turn (the environment's reply to what the model wrote). The harness sends the whole
conversation back each turn, each assistant message with the ``token_ids`` its choice returned
(rollq's extension field). The trainer assembles the episode's token ids from what the server
returned: the part of each prompt it has not seen (loss mask 0) and each completion (mask 1).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

SYSTEM = "You operate a calculator tool. Reply with a call."


@dataclass
class Episode:
    """One episode as the trainer holds it."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    #: Turns whose server prompt did not start with the ids the trainer already held.
    drift: int = 0


def tool_reply(episode: int, turn: int, call: str) -> str:
    """The environment: a deterministic observation of the model's call."""
    return f"result[{episode}.{turn}] = {len(call) * (turn + 1)} ({call[:12]!r})"


async def run_episode(client: Any, model: str, k: int, turns: int, max_tokens: int, **kw: Any) -> Episode:
    ep = Episode(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {k}: add {k} and 7."}])
    for t in range(turns):
        r = await client.chat.completions.create(
            model=model, messages=ep.messages, max_tokens=max_tokens, extra_body={"return_token_ids": True, **kw})
        prompt, comp = list(r.prompt_token_ids), list(r.choices[0].token_ids)
        if prompt[: len(ep.ids)] != ep.ids:
            ep.drift += 1
        ep.ids += prompt[len(ep.ids):]
        ep.mask += [0] * (len(ep.ids) - len(ep.mask))
        ep.ids += comp
        ep.mask += [1] * len(comp)
        ep.completions.append(comp)
        text = r.choices[0].message.content or ""
        ep.messages.append({"role": "assistant", "content": text, "token_ids": comp})
        ep.messages.append({"role": "tool", "content": tool_reply(k, t, text)})
    return ep


async def run_episodes(client: Any, model: str, episodes: int, turns: int, max_tokens: int, concurrency: int,
                       **kw: Any) -> list[Episode]:
    """``episodes`` episodes of ``turns`` model turns, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(k: int) -> Episode:
        async with gate:
            return await run_episode(client, model, k, turns, max_tokens, **kw)

    return list(await asyncio.gather(*(one(k) for k in range(episodes))))


def reference_ids(tok: Any, ep: Episode) -> tuple[list[int], list[int]]:
    """The chat template of the episode's conversation up to its last completion, built turn by
    turn from the tokenizer alone: each non-model stretch is the template's rendered text
    between two model turns, tokenised; each model turn is its sampled ids. Returns (ids, mask)."""
    ids: list[int] = []
    mask: list[int] = []
    rendered_before = ""
    n_model = 0
    for i, m in enumerate(ep.messages):
        if m["role"] != "assistant":
            continue
        # the template's text of everything before this model turn, with the generation prompt
        head = tok.apply_chat_template([{"role": x["role"], "content": x["content"]} for x in ep.messages[:i]],
                                       tokenize=False, add_generation_prompt=True)
        # the part after the previous model turn's content (its closing, the tool turn, the new header)
        prev_text = ep.messages[i - 2]["content"] if n_model else None
        if prev_text is not None:
            assert head.startswith(rendered_before + prev_text)
            gap = head[len(rendered_before + prev_text):]
        else:
            gap = head
        gap_ids = tok(gap, add_special_tokens=False)["input_ids"] if gap else []
        ids += gap_ids
        mask += [0] * len(gap_ids)
        ids += ep.completions[n_model]
        mask += [1] * len(ep.completions[n_model])
        rendered_before = head
        n_model += 1
    return ids, mask


def check_episode(tok: Any, ep: Episode) -> None:
    """The trainer's ids equal the chat template of the conversation with each model turn's
    sampled ids in place, no drift on any turn, and the mask marks exactly the sampled ids."""
    assert ep.drift == 0, f"{ep.drift} turns re-tokenised what the trainer held"
    ref_ids, ref_mask = reference_ids(tok, ep)
    assert ep.ids == ref_ids
    assert ep.mask == ref_mask
    assert [t for t, m in zip(ep.ids, ep.mask) if m] == [t for c in ep.completions for t in c]
    assert sum(ep.mask) == sum(len(c) for c in ep.completions)


def naive_drift(tok: Any, ep: Episode) -> int:
    """Model turns whose text, put back through the chat template, does not give back the
    sampled ids (what a server that re-tokenises the conversation would feed the model)."""
    whole = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in ep.messages[:-1]],
                                    tokenize=True, add_generation_prompt=False)
    if not isinstance(whole, list):
        whole = list(whole["input_ids"])
    return int(whole[: len(ep.ids)] != ep.ids)
