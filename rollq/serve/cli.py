"""``rollq serve``: vLLM's OpenAI routes in front of a queue (see :mod:`rollq.serve`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..settings import ENV_URL

#: The API key's environment variable (as ``VLLM_API_KEY`` for ``vllm serve``): kept out of ps.
ENV_API_KEY = "ROLLQ_SERVE_API_KEY"


def register(sub: Any) -> argparse.ArgumentParser:
    """Add ``rollq serve`` to the main CLI's subparsers."""
    p = sub.add_parser("serve", help="vLLM's OpenAI-compatible HTTP routes in front of the queue")
    p.add_argument("--url", default=None, help=f"Redis URL (default: ${ENV_URL} or redis://127.0.0.1:6379/0)")
    p.add_argument("--queue", required=True)
    p.add_argument("--host", default="127.0.0.1", help="listen address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(ENV_API_KEY),
                   help=f"clients must send 'Authorization: Bearer KEY' (default: ${ENV_API_KEY})")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: --tokenizer, else the queue)")
    p.add_argument("--tokenizer", default=None, help="the served model's tokenizer: chat template applied here")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..producer.client import Producer
    from .app import create_app

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    app = create_app(Producer(args.url, args.queue), model_name=args.model_name or args.tokenizer or args.queue,
                     tokenizer=tokenizer, api_key=args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
