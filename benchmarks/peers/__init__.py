"""Peer job queues measured side by side with rollq (see ``benchmarks/queue_bench.py``).

One module per peer, each with the same shape:

- ``NAME``, ``NOTES``: what exactly is measured (enqueue API, worker, result storage, knobs);
- ``enqueue(url, jobs)``: the peer's fastest documented bulk enqueue of ``jobs``, a list of
  ``(tokens, max_tokens)`` (sync or async);
- ``worker_cmd(url, burst)``: argv of ONE worker process of the peer's own worker;
- ``rt_open(url)`` / ``rt_call(ctx, tokens, max_tokens)`` / ``rt_close(ctx)``: one job
  submitted and its result awaited (single-job round trip), optional.

Every peer's task is the same null task: ``tick()`` then return the first ``max_tokens``
tokens (what rollq's EchoEngine returns). ``tick()`` timestamps the first and last task of
the worker process in a small file, so the drain is timed inside the worker (first task
start to last task end) without any extra Redis traffic.

``run_peer.py`` drives one peer in its own process tree.
"""

PEERS = ("arq", "rq", "celery", "taskiq", "saq", "bullmq")
