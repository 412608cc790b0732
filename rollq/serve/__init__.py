"""vLLM's OpenAI-compatible HTTP routes in front of a rollq queue (``rollq serve``).

Each request is one rollq job; each choice carries the policy version span and the version of
every token in a ``rollq`` extension field. The server needs starlette and uvicorn (the
``dashboard`` extra), not the ``openai`` package.

>>> from rollq.serve import create_app                                   # doctest: +SKIP
>>> app = create_app(producer, model_name="tiny", api_key="secret")      # doctest: +SKIP
"""

from .app import create_app

__all__ = ["create_app"]
