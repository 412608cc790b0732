"""vLLM's OpenAI-compatible HTTP routes in front of a rollq queue (``rollq serve``).

Each request is one rollq job; each choice carries the policy version span and the version of
every token in a ``rollq`` extension field. Routes: vLLM's OpenAI completions and chat, and its
token-in/token-out ``POST /inference/v1/generate`` (prime-rl's orchestrator), whose choices also
carry vLLM's ``weight_versions`` spans. An assistant message sent back with its choice's
``token_ids`` keeps those ids exactly in the next prompt (agent loops without re-tokenisation
drift; :mod:`rollq.serve.template`). The server needs starlette and uvicorn (the
``dashboard`` extra), not the ``openai`` package.

>>> from rollq.serve import create_app                                   # doctest: +SKIP
>>> app = create_app(producer, model_name="tiny", api_key="secret")      # doctest: +SKIP
"""

from .app import create_app

__all__ = ["create_app"]
