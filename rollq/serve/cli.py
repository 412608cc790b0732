"""``rollq serve``: vLLM's OpenAI routes in front of a queue (see :mod:`rollq.serve`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..settings import ENV_URL

#: The weight-transfer backends (:data:`rollq.serve.weight_group.BACKENDS`, which imports torch).
WEIGHT_BACKENDS = ("nccl", "gloo")

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
    w = p.add_argument_group("weight transfer (vLLM's development routes that TRL's VLLMClient calls)")
    w.add_argument("--weight-transfer", choices=WEIGHT_BACKENDS, default=None,
                   help="join a trainer's weight-update group as its one receiving rank and publish each update as a "
                        "rollq version (off: /server_info reports weight_transfer_config null)")
    w.add_argument("--weight-root", default=None,
                   help="the memmap store the replicas read (their weight-sync root); needed with --weight-transfer")
    w.add_argument("--weight-model", default=None,
                   help="the served model's folder (safetensors), the full state partial updates merge into "
                        "(default: --tokenizer)")
    w.add_argument("--weight-timeout", type=float, default=300.0, help="seconds a rendezvous or one update's receive may take")
    w.add_argument("--weight-device", default=None, help="CUDA device the nccl backend receives on (default: the current one)")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..producer.client import Producer
    from .app import create_app

    weights = None
    if args.weight_transfer:
        from .weights import WeightTransferConfig

        if not args.weight_root:
            raise SystemExit("rollq serve: --weight-transfer needs --weight-root (the memmap store the replicas read)")
        weights = WeightTransferConfig(backend=args.weight_transfer, root=args.weight_root,
                                       model=args.weight_model or args.tokenizer, timeout=args.weight_timeout,
                                       device=args.weight_device)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    app = create_app(Producer(args.url, args.queue), model_name=args.model_name or args.tokenizer or args.queue,
                     tokenizer=tokenizer, api_key=args.api_key,
                     session_margin=None if args.session_margin < 0 else args.session_margin, session_ttl=args.session_ttl,
                     weights=weights)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
