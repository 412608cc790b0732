"""The chat template applied once, on the server, keeping a model turn's exact token ids.

An agent harness sends the whole conversation back every turn. Applying the template to it
re-tokenises the model's earlier replies from their text, and a reply's text does not always
tokenise back to the tokens the model sampled (byte-level BPE merges differ), so the prompt
of turn ``t + 1`` stops extending the tokens of turn ``t``: the trainer's sequence drifts from
what the model saw. An assistant message that carries ``token_ids`` (rollq's extension field:
the ``token_ids`` of the choice that produced it) keeps those ids: the template is rendered to
text with a marker in place of that message's content, the text between markers is tokenised
as the template would tokenise it, and the exact ids go where the markers were.

>>> class Chars:  # a tokenizer of one id per character, for the example
...     def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
...         return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<a>" if add_generation_prompt else "")
...     def __call__(self, text, add_special_tokens):
...         return {"input_ids": [ord(c) for c in text]}
>>> ids = template_ids(Chars(), [{"role": "u", "content": "h"}, {"role": "a", "content": "x"}], {1: [7, 7]}, False, {})
>>> ids == [ord(c) for c in "<u>h<a>"] + [7, 7]
True
"""

from __future__ import annotations

import uuid
from typing import Any


def _ids(encoded: Any) -> list[int]:
    if not isinstance(encoded, list):  # a BatchEncoding
        encoded = list(encoded["input_ids"])
    return [int(t) for t in encoded]


def template_ids(tokenizer: Any, messages: list[dict[str, Any]], exact: dict[int, list[int]],
                 add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> list[int]:
    """The prompt's token ids: ``tokenizer.apply_chat_template`` of ``messages``, with the
    content of message ``i`` given as ``exact[i]`` (token ids) for every ``i`` in ``exact``."""
    if not exact:
        return _ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs))
    marker = f"\x00rollq-{uuid.uuid4().hex}\x00"
    marked = [{**m, "content": marker} if i in exact else m for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    parts = text.split(marker)
    if len(parts) != len(exact) + 1:
        raise ValueError("the chat template does not render each assistant message's content once")
    out: list[int] = []
    for part, i in zip(parts, sorted(exact)):
        out += _ids(tokenizer(part, add_special_tokens=False)) if part else []
        out += exact[i]
    return out + (_ids(tokenizer(parts[-1], add_special_tokens=False)) if parts[-1] else [])
