"""Streaming through ``rollq serve``: time to first token and tokens/s, streamed against not.

Redis + one ``rollq consume`` replica (``--engine echo`` with ``--echo-delay-ms`` per token,
or ``--engine vllm`` on the locally built tiny model, CPU) + ``rollq serve``, all on
127.0.0.1, started here and stopped by pid. The client is the ``openai`` SDK: ``--prompts``
completions of token-id prompts at once (``max_tokens`` ``--gen-len``, ``ignore_eos``),
first without ``stream`` then with it, alternating for ``--reps`` rounds after a warm-up of
each. Per request: time to first token (streamed: the first chunk with tokens; not streamed:
the whole answer, which is when its client sees its first token). Per round: tokens/s =
completion tokens / wall time of the batch.

    python benchmarks/serve_stream.py --engine echo --echo-delay-ms 5 --prompts 16 --gen-len 128 --reps 3
    python benchmarks/serve_stream.py --engine vllm --prompts 8 --gen-len 128 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_overhead import engine_flags, free_port, log, start, stop, vllm_device, wait_ready  # noqa: E402

MODEL = "tiny"
KEY = "sk-bench"


async def one(client: Any, prompt: list[int], gen_len: int, stream: bool) -> tuple[float, int, int]:
    """(seconds to the first token, completion tokens, chunks with tokens) of one request."""
    t0 = time.perf_counter()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=gen_len, temperature=1.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    if not stream:
        r = await client.completions.create(**kw)
        return time.perf_counter() - t0, r.usage.completion_tokens, 1
    first, toks, chunks = None, 0, 0
    async for chunk in await client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            n = len(getattr(c, "token_ids", None) or [])
            if n:
                toks += n
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    assert first is not None
    return first, toks, chunks


async def batch(base: str, prompts: list[list[int]], gen_len: int, stream: bool) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts)),
                                                              timeout=900))
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(one(client, p, gen_len, stream) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    toks = sum(r[1] for r in rs)
    assert toks == len(prompts) * gen_len, toks
    ttft = sorted(r[0] for r in rs)
    return {"tokens_per_s": toks / wall, "wall_s": wall, "ttft_median_s": statistics.median(ttft),
            "ttft_max_s": ttft[-1], "chunks_per_request": statistics.mean(r[2] for r in rs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["echo", "vllm"], default="echo")
    ap.add_argument("--echo-delay-ms", type=float, default=5.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serve_stream_<engine>")
    a = ap.parse_args()
    out_base = a.out or f"benchmarks/results/serve_stream_{a.engine}"

    from rollq.server import RedisServer
    from rollq.testing.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 1000) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    logdir = Path(tempfile.mkdtemp(prefix="rollq-serve-stream-"))
    py = sys.executable
    srv = RedisServer(appendfsync="everysec").start()
    procs = []
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "stream": []}
    try:
        port, queue = free_port(), "serve-stream"
        rlog, slog = logdir / "rollq_consume.log", logdir / "rollq_serve.log"
        engine = (["--engine", "echo", "--echo-delay-ms", str(a.echo_delay_ms)] if a.engine == "echo" else
                  ["--engine", "vllm", "--model", model, *engine_flags(a.kv_cache_memory_bytes)])
        procs.append(start([py, "-m", "rollq.cli", "consume", *engine, "--url", srv.url, "--queue", queue,
                            "--max-inflight", str(a.prompts), "--initial-inflight", str(a.prompts)], rlog))
        procs.append(start([py, "-m", "rollq.cli", "serve", "--url", srv.url, "--queue", queue, "--port", str(port),
                            "--model-name", MODEL, "--tokenizer", model], slog, env={"ROLLQ_SERVE_API_KEY": KEY}))
        log(f"starting rollq consume ({a.engine}) + rollq serve")
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/health", procs, slog)
        asyncio.run(batch(base, prompts[:1], 1, False))  # serving once the replica answered a job
        for stream in (False, True):  # warm-up
            asyncio.run(batch(base, prompts, a.gen_len, stream))
        for i in range(a.reps):
            for name, stream in (("plain", False), ("stream", True)) if i % 2 == 0 else (("stream", True), ("plain", False)):
                r = asyncio.run(batch(base, prompts, a.gen_len, stream))
                log(f"rep {i} {name}: {r['tokens_per_s']:.0f} tokens/s, first token {r['ttft_median_s'] * 1000:.0f} ms "
                    f"(median), {r['chunks_per_request']:.1f} chunks/request")
                runs[name].append(r)
    finally:
        stop(procs)
        srv.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    summary = {name: {k: med(name, k) for k in ("tokens_per_s", "ttft_median_s", "ttft_max_s", "chunks_per_request")}
               for name in runs}
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                           "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if a.engine == "vllm":
        import vllm

        env["vllm"] = vllm.__version__
        env["device"] = vllm_device()
    else:
        env["device"] = f"cpu (echo engine, {a.echo_delay_ms} ms per token)"
    out = {"engine": a.engine, "echo_delay_ms": a.echo_delay_ms if a.engine == "echo" else None, "prompts": a.prompts,
           "prompt_tokens": a.prompt_len, "gen_tokens": a.gen_len, "reps": a.reps, "runs": runs, "median": summary,
           "env": env}
    Path(out_base).parent.mkdir(parents=True, exist_ok=True)
    Path(out_base + ".json").write_text(json.dumps(out, indent=2))
    p, s = summary["plain"], summary["stream"]
    cmd = f"python benchmarks/serve_stream.py --engine {a.engine}" + (
        f" --echo-delay-ms {a.echo_delay_ms:g}" if a.engine == "echo" else "") + (
        f" --prompts {a.prompts} --prompt-len {a.prompt_len} --gen-len {a.gen_len} --reps {a.reps}")
    md = (f"# rollq serve: streamed against not ({env['device']})\n\n`{cmd}` ({env['at']}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}); {a.prompts} requests at once, {a.gen_len} tokens each; medians "
          f"over {a.reps} rounds\n\n"
          "| `stream` | first token, median of requests | first token, slowest request | tokens/s | chunks with tokens per request |\n"
          "| --- | --- | --- | --- | --- |\n"
          f"| false | {p['ttft_median_s'] * 1000:.0f} ms | {p['ttft_max_s'] * 1000:.0f} ms | {p['tokens_per_s']:.0f} | 1 |\n"
          f"| true | {s['ttft_median_s'] * 1000:.0f} ms | {s['ttft_max_s'] * 1000:.0f} ms | {s['tokens_per_s']:.0f} | "
          f"{s['chunks_per_request']:.1f} |\n\n"
          f"time to first token, streamed / not: **{s['ttft_median_s'] / p['ttft_median_s']:.3f}x**; tokens/s, streamed / "
          f"not: **{s['tokens_per_s'] / p['tokens_per_s']:.3f}x**\n")
    Path(out_base + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
