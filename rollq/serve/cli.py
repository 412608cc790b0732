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
    p.add_argument("--session-margin", type=int, default=8,
                   help="a session (X-Session-ID header or 'user') stays on its replica unless that holds more than "
                        "this many jobs above the least loaded one (-1: sticky sessions off)")
    p.add_argument("--session-ttl", type=float, default=3600.0, help="seconds a session is remembered after its last request")
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
                     tokenizer=tokenizer, api_key=args.api_key,
                     session_margin=None if args.session_margin < 0 else args.session_margin, session_ttl=args.session_ttl)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
