"""rollq on GPUs with a real vLLM engine (7B-shaped, dummy weights), in one run:

    python benchmarks/gpu_vllm.py --out benchmarks/results/gpu_vllm [--phases overhead,sync,native,memmap,ipc]

1. **overhead**: the same workload (1024 prompts of 128 tokens, 256 generated tokens each,
   ignore_eos) sent straight to ``AsyncLLM.generate`` and through rollq (producer -> Redis ->
   consumer -> the same engine), alternating direct / rollq / rollq / direct; tokens/s.
2. **sync** (needs 2 GPUs): rollq's NCCL path into the running engine under load (256
   requests running): the trainer (GPU 0, another process) broadcasts into the replica's
   staging buffer while it serves, then the replica pauses only to swap. End to end (publish
   call to the replica serving the new version) and generation stopped.
3. **native**: vLLM's own packed NCCL update in the same engine and the same load:
   ``pause_generation(keep)`` + start/update/finish + ``resume_generation``.
4. **memmap**: publish through ``/dev/shm`` from the trainer's GPU tensors and load into the
   engine (write, read + copy + load), GB/s.
5. **ipc** (one GPU: run with ``ROLLQ_ENGINE_GPU=0``; the trainer is on GPU 0 too): CUDA IPC
   from the trainer's tensors into the replica's shadow, device to device while it serves, then
   the swap. End to end, generation stopped, and the trainer's extra GPU memory for exposing
   the version. The trainer publishes it without a memmap copy (a second publisher with no
   store), as a colocated trainer whose replicas are all on its GPU would. ``--ipc-keep 1,0``
   alternates the replica keeping the trainer's storages mapped from one version to the next
   (``WeightSyncSettings.ipc_keep_mappings``) with opening every handle each version;
   ``--ipc-prestage 0,1`` the follower starting each copy with the workers starting it when
   the version is announced (``WeightSyncSettings.ipc_prestage``); ``--ipc-expose
   tensors,snapshot,lease`` the trainer's own tensors (zero-copy, checksummed at publish and by
   the replica), the publisher's snapshot (``WeightPublisher(ipc_snapshot=True)``: copied at
   publish, no checksums) and the trainer's tensors leased (``WeightPublisher(ipc_lease=True)``:
   zero-copy, no checksums, ``release_weights`` before the trainer changes them) and ``direct``
   (leased, and the replica's swap copies them straight into the live weights:
   ``WeightSyncSettings.ipc_direct``), each also as ``<way>-reshare``: every storage shared
   again each version, as the trainer did before f95f0ec (``--ipc-expose direct,direct-reshare``
   is that change before and after);
   ``--ipc-snapshot 0,1`` is ``--ipc-expose tensors,snapshot``; ``--ipc-priority 0,1`` the
   replica's copies on a stream of the engine's priority or a higher one
   (``WeightSyncSettings.ipc_high_priority``); ``--ipc-swap-end redis,engine`` a direct swap's
   follower learning that the copies ended from the watching workers' writes to Redis, or
   from the engine's answers alone (``IpcReceive.read_swap_ends``).

Results go to ``<out>.json`` and ``<out>.md``; each phase is written as soon as it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

QWEN7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False,
    "sliding_window": 131072, "max_window_layers": 28, "attention_dropout": 0.0, "initializer_range": 0.02,
}


def model_dir(path: Path) -> Path:
    """A Qwen2.5-7B-shaped config (dummy weights) with the locally built tiny tokenizer."""
    from rollq.testing.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model()
    path.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if "token" in f.name or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps(QWEN7B))
    return path


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# trainer process (GPU 0)
# ---------------------------------------------------------------------------------------
def trainer_main(url: str, queue: str, root: str, conn: object) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("ROLLQ_TRAINER_GPU", "0")
    import torch

    from benchmarks.gpu_nccl_transport import qwen7b_shapes
    from rollq.weightsync.nccl import BroadcastSender
    from rollq.weightsync.trainer.publisher import WeightPublisher
    from rollq.weightsync.transports.ipc_lease import SHARES

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device=dev).normal_() * 0.02 for n, s in qwen7b_shapes()}
    torch.cuda.synchronize()
    base_mem = torch.cuda.memory_allocated(dev)  # the trainer's own tensors: extra memory is counted above it

    async def serve() -> None:
        sender = BroadcastSender(1, backend="nccl", bucket_bytes=1 << 30, timeout=300, device=dev)
        pub = WeightPublisher(url, queue, root=root, sender=sender)
        ipc_pub = WeightPublisher(url, queue)  # no memmap copy: every replica is on this GPU
        native_group = None
        marks = 0
        reshare = False
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            op = cmd["op"]
            try:
                if op == "configure":  # the variant of the next sends
                    sender.shadow_layout = bool(cmd.get("shadow_layout", sender.shadow_layout))
                    if "ipc_expose" in cmd:
                        way = cmd["ipc_expose"].removesuffix(RESHARE)
                        ipc_pub.ipc_snapshot, ipc_pub.ipc_lease = way == "snapshot", way in ("lease", "direct")
                        reshare = cmd["ipc_expose"].endswith(RESHARE)
                    conn.send({"ok": True})
                elif op == "publish":
                    r0 = time.perf_counter()  # a leased version is released before the tensors change
                    released = await ipc_pub.release_weights(timeout=60) if ipc_pub.ipc_lease else {}
                    release_s = time.perf_counter() - r0
                    marks += 1  # the replica must then show exactly this value (checks the swap)
                    for t in tensors.values():
                        t.view(-1)[:4].fill_(float(marks))
                    torch.cuda.synchronize()
                    if reshare:  # the messages of the last version forgotten: every storage shared again
                        SHARES.pop(ipc_pub, None)
                    mem0 = torch.cuda.memory_allocated(dev)
                    t0 = time.time()
                    rec = await (ipc_pub if cmd["transport"] == "ipc" else pub).publish_weights(tensors, transport=cmd["transport"])
                    t1 = time.time()
                    conn.send({"ok": True, "t0": t0, "t1": t1, "version": rec.version, "transport": rec.transport,
                               "timings": rec.timings, "nbytes": rec.nbytes, "mark": float(marks),
                               "trainer_extra_gpu_bytes": torch.cuda.memory_allocated(dev) - mem0,
                               "release_s": release_s, "released": released,
                               "trainer_held_gpu_bytes": torch.cuda.memory_allocated(dev) - base_mem})
                elif op == "native_init":
                    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

                    native_group = await asyncio.to_thread(
                        NCCLWeightTransferEngine.trainer_init,
                        {"master_address": "127.0.0.1", "master_port": cmd["port"], "world_size": 2},
                    )
                    conn.send({"ok": True})
                elif op == "native_send":
                    from vllm.distributed.weight_transfer.nccl_engine import (
                        NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine,
                    )

                    t0 = time.time()
                    await asyncio.to_thread(
                        NCCLWeightTransferEngine.trainer_send_weights, iter(tensors.items()),
                        NCCLTrainerSendWeightsArgs(group=native_group, packed=True),
                    )
                    torch.cuda.synchronize()
                    conn.send({"ok": True, "t0": t0, "t1": time.time()})
                elif op == "quit":
                    await ipc_pub.close()
                    conn.send({"ok": True})
                    return
            except Exception as e:
                conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()})

    asyncio.run(serve())


# ---------------------------------------------------------------------------------------
# engine process (GPU 1, or GPU 0 when only overhead runs)
# ---------------------------------------------------------------------------------------
async def overhead(engine, url: str, n: int, prompt_len: int, gen_len: int) -> dict:
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from rollq import Consumer, ConsumerSettings, Producer

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(n)]
    llm = engine.llm

    async def direct() -> float:
        sp = VSP(max_tokens=gen_len, ignore_eos=True, temperature=1.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

        async def one(i: int) -> int:
            last = None
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompts[i]), sp, request_id=f"d{time.time_ns()}-{i}"):
                last = out
            return len(last.outputs[0].token_ids)

        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(i) for i in range(n))))
        return toks / (time.perf_counter() - t0)

    async def via_rollq() -> float:
        q = f"ovh-{time.time_ns()}"
        c = Consumer(engine, url, q, settings=ConsumerSettings(max_inflight=n, initial_inflight=n, adaptive=False, batch=n))
        task = asyncio.create_task(c.run())
        async with Producer(url, q) as p:
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            hs = await p.submit_many(
                {"prompt_token_ids": prompts[i], "sampling": {"max_tokens": gen_len, "ignore_eos": True, "detokenize": False}}
                for i in range(n)
            )
            rs = await p.gather(hs, timeout=900)
            dt = time.perf_counter() - t0
        c.stop()
        await task
        assert all(r.ok for r in rs), [r.error for r in rs if not r.ok][:3]
        return sum(len(s.tokens) // 4 for r in rs for s in r.samples) / dt

    await direct()  # warm-up (CUDA graphs, allocator)
    runs = {"direct": [], "rollq": []}
    for kind in ("direct", "rollq", "rollq", "direct"):
        v = await (direct() if kind == "direct" else via_rollq())
        runs[kind].append(v)
        log(f"overhead {kind}: {v:.0f} tokens/s")
    d, r = sum(runs["direct"]) / 2, sum(runs["rollq"]) / 2
    return {"prompts": n, "prompt_tokens": prompt_len, "gen_tokens": gen_len, "runs": runs,
            "direct_tokens_per_s": d, "rollq_tokens_per_s": r, "ratio": r / d}


class Load:
    """Keeps ~``target`` long requests running through a rollq consumer."""

    def __init__(self, url: str, queue: str, target: int):
        self.url, self.queue, self.target = url, queue, target
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        from rollq import Producer

        async with Producer(self.url, self.queue) as p:
            specs = lambda k: [{"prompt_token_ids": [5] * 64, "sampling": {"max_tokens": 1800, "ignore_eos": True, "detokenize": False}}] * k  # noqa: E731
            await p.submit_many(specs(self.target * 2))
            async for r in p.results():
                await p.submit_many(specs(1))


async def engine_main(a: argparse.Namespace) -> None:
    from rollq import Consumer, ConsumerSettings, RedisServer
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync.replica.follower import WeightFollower
    from rollq.weightsync.replica.worker_calls import WorkerCalls

    out: dict = {"phases": {}, "env": {}}
    res_path = Path(a.out + ".json")
    res_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res_path.write_text(json.dumps(out, indent=2, default=str))
        Path(a.out + ".md").write_text(render(out))

    phases = a.phases.split(",")
    if a.tiny:
        from rollq.testing.tiny_model import ensure_tiny_model

        mdir = ensure_tiny_model()
    else:
        mdir = model_dir(Path("/tmp/rollq-7b"))
    root = "/dev/shm/rollq-weights"
    shutil.rmtree(root, ignore_errors=True)
    import torch

    gpu = torch.cuda.is_available()
    out["env"] = {"gpu": torch.cuda.get_device_name(0) if gpu else "cpu", "gpus": torch.cuda.device_count(),
                  "torch": torch.__version__, "model": "tiny" if a.tiny else "qwen2.5-7b-shaped (dummy)",
                  "workload": {"prompts": a.prompts, "prompt_tokens": a.prompt_len, "gen_tokens": a.gen_len}}
    srv = RedisServer(appendfsync="everysec").start()
    queue = "bench"
    trainer = conn = None
    if any(p in phases for p in ("sync", "native", "memmap", "ipc")):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        trainer = ctx.Process(target=trainer_main, args=(srv.url, queue, root, child), daemon=True)
        trainer.start()

    broken: list[str] = []

    def call(_timeout: float = 600.0, **cmd: object) -> dict:
        # Bounded: a dead or stuck trainer must not hang the whole run.
        if broken:
            raise RuntimeError(f"trainer unusable: {broken[0]}")
        conn.send(cmd)
        deadline = time.monotonic() + _timeout
        while not conn.poll(1.0):
            if not trainer.is_alive():
                broken.append(f"trainer process exited (code {trainer.exitcode}) during {cmd['op']}")
                raise RuntimeError(broken[0])
            if time.monotonic() > deadline:
                broken.append(f"trainer did not answer {cmd['op']} within {_timeout:.0f}s")
                raise TimeoutError(broken[0])
        r = conn.recv()
        if not r.get("ok"):
            raise RuntimeError(r.get("error", "") + "\n" + r.get("tb", ""))
        return r

    if a.tiny:
        cfg = VllmEngineConfig(model=str(mdir), max_model_len=512,
                               worker_extension_cls="rollq.weightsync.worker.ext.RollqWorkerExtension")
    else:
        from vllm.config import WeightTransferConfig

        cfg = VllmEngineConfig(
            model=str(mdir), dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=a.gpu_mem,
            worker_extension_cls="rollq.weightsync.worker.ext.RollqWorkerExtension",
            engine_kwargs={"load_format": "dummy", "weight_transfer_config": WeightTransferConfig(backend="nccl")},
        )
    engine = VllmEngine(cfg)
    replies, lags = watch_replies(), LoopLag()
    t0 = time.perf_counter()
    await engine.start()
    lag_task = asyncio.create_task(lags.run())
    out["env"].update(vllm=engine.vllm_version, engine_start_s=time.perf_counter() - t0, device=engine.device)
    log("engine up", out["env"])
    save()

    if "overhead" in phases:
        try:
            out["phases"]["overhead"] = await overhead(engine, srv.url, a.prompts, a.prompt_len, a.gen_len)
        except Exception as e:
            out["phases"]["overhead"] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        save()

    if trainer is not None:
        consumer = Consumer(engine, srv.url, queue, consumer_id="replica-0",
                            settings=ConsumerSettings(max_inflight=256, initial_inflight=256, adaptive=False, drain_timeout=2.0))
        follower = WeightFollower(consumer, WeightSyncSettings(root=root, broadcast="sync" in phases, reconcile_interval=1.0, load_timeout=600,
                                  memmap_chunks_in_flight=a.memmap_chunks))
        await follower.start()
        ctask = asyncio.create_task(consumer.run())
        load = Load(srv.url, queue, 256)
        load.task = asyncio.create_task(load.run())

        async def wait_running(k: int = 200) -> int:
            for _ in range(600):
                if consumer.running_count() >= k:
                    break
                await asyncio.sleep(0.1)
            return consumer.running_count()

        async def wait_version(v: int, timeout: float = 300.0) -> tuple[float, object]:
            """When the replica serves version ``v`` again (the follower recorded the update:
            loaded, resumed, intake reopened), and that update's stats. ``consumer.version``
            alone is set before the follower appends to ``history`` (reading
            ``history[-1]`` then gave the previous update, or IndexError on the first)."""
            deadline = time.monotonic() + timeout
            while True:
                for st in reversed(follower.history):
                    if st.version >= v:
                        return time.time(), st
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica did not apply version {v} within {timeout:.0f}s "
                                       f"(at {consumer.version}, failures {follower.failures})")
                await asyncio.sleep(0.0005)

        async def served_at(v: int, t_follower: float) -> tuple[float, dict]:
            """When version ``v`` is really serving: the follower has recorded it and the
            swap's device copies (enqueued without a host wait) have finished; and, for
            copies timed on the device (a shadow swap or a direct swap by the plan), how long
            they waited there behind the work before them and how long they ran."""
            for _ in range(2000):
                done = (await WorkerCalls(engine).swap_done())[0]
                if done.version != v:
                    return t_follower, {}  # not swapped from the shadow: the follower waited for it
                if done.done_at:
                    copies = {"copy_queued_s": done.started_at - done.enqueued_at if done.started_at else None,
                              "copy_device_s": done.device_s, "swap_enqueued_at": done.enqueued_at,
                              "copies_started_at": done.started_at}
                    return max(t_follower, done.done_at), copies
                await asyncio.sleep(0.001)
            raise TimeoutError(f"swap of version {v} did not finish on the device")

        async def weights_match(mark: float) -> bool:
            """The served weights are the published ones: every checkpoint tensor starts with
            the trainer's mark; sampled at the first, the last, and inside fused parameters
            (the v rows of layer 0's qkv_proj, the up rows of layer 13's gate_up_proj)."""
            h, kv, inter = 3584, 512, 18944
            where = [("embed_tokens", 0), ("layers.0.self_attn.qkv_proj", 0), ("layers.0.self_attn.qkv_proj", (h + kv) * h),
                     ("layers.13.mlp.gate_up_proj", inter * h), ("layers.27.mlp.down_proj", 0), ("lm_head", 0)]
            got = [(await WorkerCalls(engine).weight_sample(name_contains=n, offset=off))[0] for n, off in where]
            return all(g == [mark] * 4 for g in got)

        async def step_gaps(m0: float) -> dict:
            """Engine steps seen from just before the update until just after it: the largest
            gap is how long generation actually stood still (measured, not inferred)."""
            await asyncio.sleep(0.3)
            steps = engine.steps_seen(m0)
            gaps = [(b - a, a) for a, b in zip(steps, steps[1:])]
            if not gaps:
                return {"max_step_gap_s": None, "median_step_s": None, "steps": 0}
            longest, began = max(gaps)
            return {"max_step_gap_s": longest, "median_step_s": sorted(g for g, _ in gaps)[len(gaps) // 2],
                    "steps": len(gaps), "gap_began_at": began + (time.time() - time.monotonic())}

        def gap_timeline(row: dict, load: dict) -> dict:
            """Where the swap fell in the longest gap between engine steps, in seconds from the
            gap's start (the last step seen before it, wall clock): the follower's swap call
            began (negative: before the gap) and its call to the workers came back (the swap
            call less its wait for a direct swap's copies) and it knew the copies ended (its swap
            call's end), the worker's swap call ended (its
            copies enqueued), the device reached the copies, the copies ended; the gap ends
            when the next step is seen."""
            began, enq, start, dev = (row.get(k) for k in ("gap_began_at", "swap_enqueued_at", "copies_started_at",
                                                           "copy_device_s"))
            if began is None or not enq:
                return {}
            out = {"gap_swap_call_end_s": enq - began}
            if row.get("follower_swap_at") and row.get("paused_s") is not None:
                out["gap_follower_call_start_s"] = row["follower_swap_at"] - began
                out["gap_follower_call_return_s"] = (row["follower_swap_at"] + row["paused_s"] - (row.get("wait_copy_s") or 0.0)
                                                     - began)
                out["gap_follower_swap_end_s"] = row["follower_swap_at"] + row["paused_s"] - began
            returned = load.get("returned_at")
            if returned and row.get("follower_swap_at"):
                out["gap_worker_return_s"] = returned - began
                arrived = [t for t in replies if t >= returned]
                if arrived:  # the first engine answer to reach this process after the worker's return
                    out["gap_reply_arrived_s"] = arrived[0] - began
                t1 = row["follower_swap_at"] + (row.get("paused_s") or 0.0)
                out["loop_lag_max_s"] = lags.worst(row["follower_swap_at"], t1)
            if start is not None:
                out["gap_copies_start_s"] = start - began
                if dev is not None:
                    out["gap_copies_end_s"] = start + dev - began
            return out

        async def measured_update(transport: str) -> tuple[dict, dict, Any]:
            """One update through ``transport`` with the load running: the trainer's reply, the
            figures every phase reports (end to end, the follower's parts, the pause, the gaps
            between engine steps, whether the served weights are the published ones), and the
            follower's stats of the update."""
            running = await wait_running()
            m0 = time.monotonic()
            r = await asyncio.to_thread(call, op="publish", transport=transport)
            t_seen, st = await wait_version(r["version"])
            # The replica serves the version from the moment its follower recorded the update
            # (resumed, intake reopened), which this benchmark's poll, behind the same event
            # loop as 256 requests' outputs, sees up to ~20 ms later (t_recorded_to_seen_s).
            t_follower = st.timings.get("recorded_at") or t_seen
            t_served, copies = await served_at(r["version"], t_follower)
            row = {"version": r["version"], "transport": r["transport"], "running_at_start": running,
                   "end_to_end_s": t_served - r["t0"], "trainer_publish_s": r["t1"] - r["t0"],
                   "follower_done_s": t_follower - r["t0"], "copies_after_follower_s": t_served - t_follower,
                   "follower_read_s": st.timings.get("read_s"), "swap_call_s": st.timings.get("load_call_s"),
                   "paused_s": st.pause_s, "seen_s": t_seen - r["t0"], "follower_swap_at": st.timings.get("swap_at"),
                   "wait_copy_s": st.load.get("wait_copy_s"), **(await step_gaps(m0)),
                   **copies, "weights_match": await weights_match(r["mark"])}
            row.update(gap_timeline(row, st.load))
            return r, row, st

        def timeline(st: Any, t_published: float, t_seen: float) -> dict:
            """The waits of one update that its durations do not cover (UpdateStats.waits):
            the announcement's arrival after the publish call returned, the reconcile's start
            after it, reading and checking the record, from the staging's end to the swap, from
            the swap's end to the update being recorded, and from then to this benchmark seeing
            it served."""
            w, t = st.waits(), st.timings
            if not w:
                return {}
            return {"t_wake_s": w["wake_s"], "t_read_check_s": w["read_check_s"], "t_staged_to_swap_s": w["staged_to_swap_s"],
                    "t_swap_to_recorded_s": w["swap_to_recorded_s"], "t_recorded_to_seen_s": t_seen - t["recorded_at"],
                    "t_publish_to_hint_s": (t.get("hinted_at") or t["woke_at"]) - t_published}

        if "sync" in phases:
            rows = []
            try:
                variants = a.sync_variants.split(",")
                # The first update forms the group (and traces the load plan); then the variants
                # take turns, so each sees the same engine, load and machine noise.
                for i in range(a.sync_reps * len(variants) + 1):
                    variant = variants[(i - 1) % len(variants)] if i else variants[0]
                    await asyncio.to_thread(call, op="configure", shadow_layout=variant != "direct")
                    follower.overlap.enabled = variant.startswith("overlap")
                    if follower.overlap.enabled:  # overlap[:LEAD_MS[:PROGRAMS]]
                        opts = variant.split(":")[1:]
                        follower.overlap.lead_s = float(opts[0]) / 1000 if opts else 0.035
                        follower.overlap.programs = int(opts[1]) if len(opts) > 1 else 0
                    r, row, st = await measured_update("nccl")
                    hinted = st.timings.get("hinted_at") or 0.0
                    row = {"variant": variant, **row,
                           # after the trainer's publish call returned (the commit is its last step)
                           "hint_after_publish_s": hinted - r["t1"] if hinted else None,
                           "swap": st.load, "trainer": r["timings"]}
                    log("sync", row)
                    if i > 0:
                        rows.append(row)
                out["phases"]["sync"] = {"reps": rows}
            except Exception as e:
                out["phases"]["sync"] = {"reps": rows, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}  # the updates before it too
            save()

        if "native" in phases:
            rows = []
            try:
                from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

                from benchmarks.gpu_nccl_transport import qwen7b_shapes
                from rollq.server import free_port

                port = free_port()
                fut = asyncio.create_task(asyncio.to_thread(call, op="native_init", port=port))
                await engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(
                    init_info={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}))
                await fut
                shapes = qwen7b_shapes()
                info = {"names": [n for n, _ in shapes], "dtype_names": ["bfloat16"] * len(shapes),
                        "shapes": [list(s) for _, s in shapes], "packed": True}
                for i in range(a.sync_reps + 1):
                    running = await wait_running()
                    m0 = time.monotonic()
                    t0 = time.time()
                    consumer.intake_gate.clear()
                    await engine.llm.pause_generation(mode="keep", clear_cache=False)
                    t1 = time.time()
                    await engine.llm.start_weight_update()
                    send = asyncio.create_task(asyncio.to_thread(call, op="native_send"))
                    await engine.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
                    await send
                    await engine.llm.finish_weight_update()
                    t2 = time.time()
                    await engine.llm.resume_generation()
                    t3 = time.time()
                    consumer.intake_gate.set()
                    row = {"running_at_start": running, "pause_s": t1 - t0, "update_s": t2 - t1, "resume_s": t3 - t2,
                           "generation_stopped_s": t3 - t0, **(await step_gaps(m0))}
                    log("native", row)
                    if i > 0:
                        rows.append(row)
                out["phases"]["native"] = {"reps": rows}
            except Exception as e:
                out["phases"]["native"] = {"reps": rows, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}  # the updates before it too
            save()

        if "memmap" in phases:
            rows = []
            try:
                for i in range(a.memmap_reps):
                    r, row, st = await measured_update("memmap")
                    nb = r.get("nbytes") or 15.2e9
                    row.update(write_s=r["timings"].get("write_s"), checksum_s=r["timings"].get("checksum_s"),
                               pinned_write=r["timings"].get("pinned"), publish_s=row["trainer_publish_s"], load=st.load)
                    row["gb_per_s_publish_plus_load"] = nb / 1e9 / row["end_to_end_s"]
                    # The first use of each slot (keep=2) creates its files, the second maps and
                    # page-locks them once per process; steady state starts at the fifth update.
                    row["steady"] = i >= 4
                    log("memmap", row)
                    rows.append(row)
                out["phases"]["memmap"] = {"reps": rows}
            except Exception as e:
                out["phases"]["memmap"] = {"reps": rows, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}  # the updates before it too
            save()

        if "ipc" in phases:
            rows, warm_rows = [], []
            try:
                import dataclasses

                chunks = [int(float(c) * (1 << 20)) for c in a.ipc_chunk_mb.split(",")]
                combos = [(c, k == "1", x == "1", n, hp == "1", se) for c in chunks for k in a.ipc_keep.split(",")
                          for x in a.ipc_prestage.split(",") for n in exposures(a) for hp in a.ipc_priority.split(",")
                          for se in a.ipc_swap_end.split(",")]
                # The first traces the load plan into the shadow; then the variants take turns.
                # A kept-mappings update right after one without opens everything again, and so
                # does a switch between the publisher's snapshot and the trainer's own tensors
                # (other storages): that one is a warm-up, not measured.
                prev_keep, prev_expose, i = True, "tensors", 0
                while len(rows) < a.ipc_reps * len(combos):
                    chunk, keep, prestage, expose, high, swap_end = combos[len(rows) % len(combos)]
                    await asyncio.to_thread(call, op="configure", ipc_expose=expose)
                    warm = i == 0 or (keep and not prev_keep) or (expose == "snapshot") != (prev_expose == "snapshot") or (
                        expose.endswith(RESHARE) != prev_expose.endswith(RESHARE))
                    follower.settings = dataclasses.replace(follower.settings, ipc_chunk_bytes=chunk, ipc_keep_mappings=keep,
                                                            ipc_prestage=prestage, ipc_high_priority=high,
                                                            ipc_direct=expose.startswith("direct"))
                    for tr in follower._transports.values():
                        tr.settings = follower.settings
                    ipc = follower.transport("ipc")  # the workers watch for versions (ipc_prestage) or not
                    ipc.read_swap_ends = swap_end == "redis"
                    await ipc.close()
                    if prestage:
                        await ipc.watch(srv.url, consumer.version, consumer.id)
                    r, row, st = await measured_update("ipc")
                    hinted = st.timings.get("hinted_at") or 0.0
                    row.update(chunk_mb=chunk / (1 << 20), keep_mappings=keep, prestage=prestage, prestaged=bool(st.load.get("prestaged")),
                               expose=expose, snapshot=expose == "snapshot", snapshot_reused=r["timings"].get("ipc_snapshot_reused"),
                               release_s=r["release_s"], high_priority=high, swap_end=swap_end,
                               warm_up=warm, expose_s=r["timings"].get("expose_s"),
                               checksum_s=r["timings"].get("checksum_s"), trainer_copied_bytes=r["timings"].get("ipc_copied_bytes"),
                               trainer_extra_gpu_bytes=r["trainer_extra_gpu_bytes"], trainer_held_gpu_bytes=r.get("trainer_held_gpu_bytes"),
                               stage_s=st.load.get("stage_s"),
                               open_s=st.load.get("open_s"), verify_s=st.load.get("verify_s"), opened=st.load.get("opened"),
                               reused=st.load.get("reused"), hint_after_publish_s=hinted - r["t1"] if hinted else None,
                               stage_call_s=st.timings.get("stage_call_s"), **timeline(st, r["t1"], row["seen_s"] + r["t0"]),
                               copied_by=st.load.get("copied_by"),
                               gpu_used_mib=gpu_used_mib(), load=st.load)
                    log("ipc", {k: v for k, v in row.items() if k != "load"})
                    i, prev_keep, prev_expose = i + 1, keep, expose
                    (warm_rows if warm else rows).append(row)
                out["phases"]["ipc"] = {"reps": rows, "warm_ups": warm_rows}
            except Exception as e:
                out["phases"]["ipc"] = {"reps": rows, "warm_ups": warm_rows, "error": f"{type(e).__name__}: {e}",
                                        "tb": traceback.format_exc()}  # the updates before it too
            save()

        load.task.cancel()
        consumer.stop()
        await asyncio.wait_for(ctask, 60)
        await follower.stop()
        await asyncio.to_thread(call, op="quit")
    lag_task.cancel()
    await engine.stop()
    srv.cleanup()
    save()
    log(render(out))


def render(out: dict) -> str:
    lines = [f"rollq on {out['env'].get('gpu')} x{out['env'].get('gpus')}, vLLM {out['env'].get('vllm')}, "
             f"model {out['env'].get('model')}", ""]
    ph = out["phases"]
    if "overhead" in ph and "ratio" in ph["overhead"]:
        o = ph["overhead"]
        lines += [f"| overhead ({o['prompts']} x {o['prompt_tokens']} -> {o['gen_tokens']} tokens) | tokens/s |", "| --- | --- |",
                  f"| direct AsyncLLM | {o['direct_tokens_per_s']:.0f} |", f"| through rollq | {o['rollq_tokens_per_s']:.0f} |",
                  f"| ratio | {o['ratio']:.3f} |", ""]

    def med(rows: list, key: str) -> float:
        v = sorted(r[key] for r in rows if r.get(key) is not None)
        return v[len(v) // 2] if v else float("nan")

    if "sync" in ph and ph["sync"].get("reps"):
        allr = ph["sync"]["reps"]
        variants = list(dict.fromkeys(x.get("variant", "direct") for x in allr))
        for v in variants:
            r = [x for x in allr if x.get("variant", "direct") == v]
            e2e = sorted(x["end_to_end_s"] * 1000 for x in r)
            lines += [f"rollq NCCL update under load ({v}): end to end {med(r, 'end_to_end_s') * 1000:.0f} ms "
                      f"({e2e[0]:.0f}-{e2e[-1]:.0f}), swap call {med(r, 'paused_s') * 1000:.0f} ms, longest gap between "
                      f"engine steps {med(r, 'max_step_gap_s') * 1000:.0f} ms (median step {med(r, 'median_step_s') * 1000:.0f} ms; "
                      f"median of {len(r)}); swap by {sorted({str(x['swap'].get('swap')) for x in r})}, "
                      f"served weights equal the published ones: {all(x.get('weights_match') for x in r)}", ""]
        # where the time goes, medians per variant (ms)
        parts = [("offer", lambda x: x["trainer"].get("send_s", 0) - x["trainer"].get("broadcast_s", 0) - x["trainer"].get("acks_s", 0)),
                 ("receiver setup", lambda x: x["trainer"].get("receiver_setup_s")),
                 ("receiver enqueued", lambda x: x["trainer"].get("receiver_enqueued_s")),
                 ("broadcast", lambda x: x["trainer"].get("broadcast_s")),
                 ("acks", lambda x: x["trainer"].get("acks_s")),
                 ("publish call", lambda x: x.get("trainer_publish_s")),
                 ("announcement reaches follower", lambda x: x.get("hint_after_publish_s")),
                 ("follower read", lambda x: x.get("follower_read_s")),
                 ("swap call", lambda x: x.get("swap_call_s")),
                 ("follower done", lambda x: x.get("follower_done_s")),
                 ("copies done after that", lambda x: x.get("copies_after_follower_s")),
                 ("end to end", lambda x: x.get("end_to_end_s")),
                 ("intake closed (pause_s)", lambda x: x.get("paused_s")),
                 ("generation stopped (longest gap between steps)", lambda x: x.get("max_step_gap_s"))]
        lines += ["| ms (median) | " + " | ".join(variants) + " |", "| --- |" + " --- |" * len(variants)]
        for name, f in parts:
            cells = []
            for v in variants:
                vals = sorted(y for y in (f(x) for x in allr if x.get("variant", "direct") == v) if y is not None)
                cells.append(f"{vals[len(vals) // 2] * 1000:.1f}" if vals else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if "native" in ph and ph["native"].get("reps"):
        r = ph["native"]["reps"]
        lines += [f"vLLM native packed update under load: pause {med(r, 'pause_s') * 1000:.0f} ms + update "
                  f"{med(r, 'update_s') * 1000:.0f} ms + resume {med(r, 'resume_s') * 1000:.0f} ms = generation stopped "
                  f"{med(r, 'generation_stopped_s') * 1000:.0f} ms, longest gap between engine steps "
                  f"{med(r, 'max_step_gap_s') * 1000:.0f} ms", ""]
    if "memmap" in ph and ph["memmap"].get("reps"):
        r = [x for x in ph["memmap"]["reps"] if x.get("steady")] or ph["memmap"]["reps"]
        lines += [f"memmap via /dev/shm (steady state, {len(r)} updates): publish + load {med(r, 'end_to_end_s'):.2f} s = "
                  f"{med(r, 'gb_per_s_publish_plus_load'):.1f} GB/s, write {med(r, 'write_s'):.2f} s, "
                  f"longest gap between engine steps {med(r, 'max_step_gap_s') * 1000:.0f} ms; "
                  f"served weights equal the published ones: {all(x.get('weights_match') for x in ph['memmap']['reps'])}", ""]
    def variant(x: dict) -> tuple:
        return (x.get("chunk_mb", 0), x.get("keep_mappings", False), x.get("prestage", False),
                x.get("expose", "snapshot" if x.get("snapshot") else "tensors"), x.get("high_priority", False),
                x.get("swap_end", "engine"))

    for chunk, keep, prestage, expose, high, swap_end in sorted({variant(x) for x in ph.get("ipc", {}).get("reps", [])}):
        r = [x for x in ph["ipc"]["reps"] if variant(x) == (chunk, keep, prestage, expose, high, swap_end)]
        e2e = sorted(x["end_to_end_s"] * 1000 for x in r)
        paced = f"waits every {chunk:.0f} MiB" if chunk else "one burst"
        kept = "handles kept mapped across versions" if keep else "every handle opened each version"
        started = (f"copies started by the workers' watchers ({sum(bool(x.get('prestaged')) for x in r)} of {len(r)})"
                   if prestage else "copies started by the follower")
        way = expose.removesuffix(RESHARE)
        exposed = {"snapshot": "the publisher's own snapshot (no checksums)",
                   "lease": "the trainer's tensors leased (zero-copy, no checksums, released before they change)",
                   "direct": "the trainer's tensors leased and copied straight into the live weights at the swap "
                             "(WeightSyncSettings.ipc_direct)"}.get(
            way, "the trainer's tensors (zero-copy, checksummed)")
        if expose.endswith(RESHARE):
            exposed += ", every storage shared again each version (one _share_cuda_ per storage, as before f95f0ec)"
        prio = "copies on a high-priority stream" if high else "copies at the engine's stream priority"
        if way == "direct" and prestage:
            prio += (", the copies' end read from the workers' writes to Redis" if swap_end == "redis"
                     else ", the copies' end from the engine's answers alone")
        lines += [f"CUDA IPC on one GPU, {paced}, {kept}, {started}, {exposed}, {prio} ({len(r)} updates, "
                  f"{r[0].get('running_at_start')} requests running): end to end "
                  f"{med(r, 'end_to_end_s') * 1000:.1f} ms ({e2e[0]:.1f}-{e2e[-1]:.1f}), publish call "
                  f"{med(r, 'trainer_publish_s') * 1000:.1f} ms (expose {med(r, 'expose_s') * 1000:.1f}, checksum "
                  f"{med(r, 'checksum_s') * 1000:.1f}"
                  + (f"; the release before the next change waited {med(r, 'release_s') * 1000:.1f}" if way in ("lease", "direct") else "")
                  + f"), replica's copy {med(r, 'stage_s') * 1000:.1f} ms (open "
                  f"{med(r, 'open_s') * 1000:.1f} for {med(r, 'opened'):.0f} storages opened, {med(r, 'reused'):.0f} kept; verify "
                  f"{med(r, 'verify_s') * 1000:.1f}), announcement after the publish call {med(r, 'hint_after_publish_s') * 1000:.1f} ms, "
                  f"follower's read {med(r, 'follower_read_s') * 1000:.1f} ms, staging as the follower saw it "
                  f"{med(r, 'stage_call_s') * 1000:.1f} ms, swap call {med(r, 'paused_s') * 1000:.1f} ms"
                  + (f" (of which waiting, the engine stepping, for the direct copies' end {med(r, 'wait_copy_s') * 1000:.1f})"
                     if all(x.get("wait_copy_s") is not None for x in r) else "") + ", "
                  + (f"the swap's copies on the device {med(r, 'copy_device_s') * 1000:.1f} ms after waiting there "
                     f"{med(r, 'copy_queued_s') * 1000:.1f} ms for the work before them, "
                     if all(x.get("copy_device_s") is not None and x.get("copy_queued_s") is not None for x in r) else "")
                  + ("in the longest gap between engine steps (from the last step before it): "
                     if all(x.get("gap_copies_end_s") is not None or x.get("gap_follower_call_return_s") is not None
                            for x in r) else "")
                  + (f"the follower's swap call began at {med(r, 'gap_follower_call_start_s') * 1000:.1f} ms, its call to "
                     f"the workers came back at {med(r, 'gap_follower_call_return_s') * 1000:.1f} and it knew the copies ended "
                     f"at {med(r, 'gap_follower_swap_end_s') * 1000:.1f}, "
                     if all(x.get("gap_follower_call_return_s") is not None for x in r) else "")
                  + (f"the worker's call returned at {med(r, 'gap_worker_return_s') * 1000:.1f} ms and the first engine answer "
                     f"after it reached the follower's process at {med(r, 'gap_reply_arrived_s') * 1000:.1f} (its event loop "
                     f"ran a 1 ms timer up to {med(r, 'loop_lag_max_s') * 1000:.1f} ms late during the swap call), "
                     if all(x.get("gap_reply_arrived_s") is not None and x.get("loop_lag_max_s") is not None for x in r) else "")
                  + (f"the worker's swap call ended at {med(r, 'gap_swap_call_end_s') * 1000:.1f} ms, the device reached the copies at "
                     f"{med(r, 'gap_copies_start_s') * 1000:.1f} and ended them at {med(r, 'gap_copies_end_s') * 1000:.1f}, "
                     if all(x.get("gap_copies_end_s") is not None for x in r) else "")
                  + (f"waits the durations do not cover: reconcile after the announcement {med(r, 't_wake_s') * 1000:.1f} ms, "
                     f"reading and checking the record {med(r, 't_read_check_s') * 1000:.1f}, staged to swap "
                     f"{med(r, 't_staged_to_swap_s') * 1000:.1f}, swap to recorded {med(r, 't_swap_to_recorded_s') * 1000:.1f}, "
                     f"recorded to seen {med(r, 't_recorded_to_seen_s') * 1000:.1f}; " if all('t_wake_s' in x for x in r) else "")
                  + f"longest gap between engine "
                  f"steps {med(r, 'max_step_gap_s') * 1000:.1f} ms (median step {med(r, 'median_step_s') * 1000:.1f} ms); "
                  f"trainer's extra GPU memory {max(x.get('trainer_extra_gpu_bytes') or 0 for x in r) / 2**20:.0f} MiB in the publish "
                  f"call, {max(x.get('trainer_held_gpu_bytes') or 0 for x in r) / 2**20:.0f} MiB held beside its weights, copied "
                  f"{max(x.get('trainer_copied_bytes') or 0 for x in r) / 2**20:.0f} MiB; "
                  + (f"swaps copied by {', '.join(sorted({str(x.get('copied_by')) for x in r}))}, " if way == "direct" else "")
                  + (f"GPU memory in use after the update {max(x['gpu_used_mib'] for x in r):.0f} MiB (all processes); "
                     if all(x.get("gpu_used_mib") for x in r) else "")
                  + f"served weights equal the published ones: {all(x.get('weights_match') for x in r)}", ""]
    warm = ph.get("ipc", {}).get("warm_ups", [])
    if warm:
        lines += ["Warm-up updates, not counted above (the first traces the load plan): " + "; ".join(
            f"{x['expose']}{' (' + str(x['copied_by']) + ')' if x.get('copied_by') else ''}: end to end "
            f"{x['end_to_end_s'] * 1000:.0f} ms, swap call {x['paused_s'] * 1000:.1f} ms, longest gap between engine steps "
            f"{x['max_step_gap_s'] * 1000:.1f} ms" for x in warm), ""]
    for k, v in ph.items():
        if "error" in v:
            lines.append(f"{k}: ERROR {v['error']}")
    return "\n".join(lines) + "\n"


def watch_replies() -> list[float]:
    """When each engine call's answer reached this process (``time.time()``): vLLM's client
    hands every answer to ``_process_utility_output``, wrapped here to note the time."""
    got: list[float] = []
    try:
        from vllm.v1.engine import core_client
    except ImportError:
        return got
    real = core_client._process_utility_output

    def noted(output: Any, results: Any) -> None:
        got.append(time.time())
        real(output, results)

    core_client._process_utility_output = noted
    return got


class LoopLag:
    """How late this process's event loop runs a task that asks to wake every millisecond:
    (wall clock, lateness) per wake."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            self.seen.append((time.time(), loop.time() - due))
            if len(self.seen) > 2_000_000:
                del self.seen[:1_000_000]

    def worst(self, t0: float, t1: float) -> float | None:
        got = [lag for t, lag in self.seen if t0 <= t <= t1]
        return max(got) if got else None


def gpu_used_mib() -> float | None:
    """Memory in use on GPU 0 by every process (nvidia-smi; None without it)."""
    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        return float(got.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


#: An ``--ipc-expose`` value with this suffix has the trainer share every storage again each
#: version (its publisher's messages forgotten before each publish), the way before f95f0ec.
RESHARE = "-reshare"


def exposures(a: argparse.Namespace) -> list[str]:
    """The ``--ipc-expose`` values to take turns, or ``--ipc-snapshot``'s as those values."""
    if a.ipc_expose:
        got = a.ipc_expose.split(",")
        bad = sorted({g.removesuffix(RESHARE) for g in got} - {"tensors", "snapshot", "lease", "direct"})
        if bad:
            raise SystemExit(f"--ipc-expose: unknown {', '.join(bad)} (tensors, snapshot, lease, direct, each with "
                             f"{RESHARE} for every storage shared again each version)")
        return got
    return ["snapshot" if n == "1" else "tensors" for n in a.ipc_snapshot.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu_vllm")
    ap.add_argument("--phases", default="overhead,sync,native,memmap")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--sync-reps", type=int, default=3)
    ap.add_argument("--memmap-reps", type=int, default=6)
    ap.add_argument("--ipc-reps", type=int, default=6, help="updates per --ipc-chunk-mb value")
    ap.add_argument("--ipc-chunk-mb", default="0",
                    help="comma list taking turns in the ipc phase: WeightSyncSettings.ipc_chunk_bytes in MiB (0: one burst)")
    ap.add_argument("--ipc-prestage", default="0",
                    help="comma list taking turns in the ipc phase: WeightSyncSettings.ipc_prestage (1: the workers start each copy "
                         "when the version is announced, 0: the follower starts it after reading the record)")
    ap.add_argument("--ipc-snapshot", default="0",
                    help="comma list taking turns in the ipc phase: WeightPublisher(ipc_snapshot=...) (1: the publisher's own "
                         "copy of each version, rewritten every version, no checksums; each switch adds a warm-up update)")
    ap.add_argument("--ipc-expose", default=None,
                    help="comma list taking turns in the ipc phase: how the trainer exposes each version: tensors (zero-copy, "
                         "checksummed), snapshot (WeightPublisher(ipc_snapshot=True)), lease (WeightPublisher(ipc_lease=True)), "
                         "direct (leased, and WeightSyncSettings(ipc_direct=True) on the replica); each also as "
                         "<way>-reshare (every storage shared again each version); default: as --ipc-snapshot says")
    ap.add_argument("--ipc-priority", default="0",
                    help="comma list taking turns in the ipc phase: WeightSyncSettings.ipc_high_priority (1: the replica's "
                         "copies on a high-priority CUDA stream)")
    ap.add_argument("--ipc-swap-end", default="redis",
                    help="comma list taking turns in the ipc phase: how a direct swap's follower learns that the copies "
                         "ended: redis (the watching workers' writes, and the engine's answers) or engine (its answers "
                         "alone); only with --ipc-prestage 1")
    ap.add_argument("--ipc-keep", default="1",
                    help="comma list taking turns in the ipc phase: WeightSyncSettings.ipc_keep_mappings (1: kept, 0: opened every version)")
    ap.add_argument("--memmap-chunks", type=int, default=3, help="256 MiB read chunks in flight (0: unthrottled)")
    ap.add_argument("--gpu-mem", type=float, default=0.55,
                    help="the engine's gpu_memory_utilization; 0.55 is sized for a 140 GB H200. The ipc phase puts "
                         "the trainer's 15.2 GB and the replica's 15.2 GB shadow beside it on one GPU: on an 80 GB "
                         "H100 use 0.35 (0.55 ran out of memory there)")
    ap.add_argument("--sync-variants", default="direct",
                    help="comma list taking turns in the sync phase: direct (one broadcast per tensor, coalesced), "
                         "layout (BroadcastSender(shadow_layout=True): buckets in the receivers' flat shadow layout), "
                         "overlap[:LEAD_MS[:PROGRAMS]] (layout, and WeightSyncSettings(swap_overlap=True): swapped in part by part "
                         "while the last parts arrive, generation stopped from LEAD_MS before the receive's expected end; "
                         "PROGRAMS caps the exchange kernel's blocks)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="the local tiny model (CPU runs): overhead phase only")
    a = ap.parse_args()
    if a.tiny:
        a.phases = "overhead"
    if any(p in a.phases for p in ("sync", "native", "memmap", "ipc")):
        # The engine on GPU 1 beside the trainer's GPU 0; ipc alone puts both on GPU 0.
        alone = set(a.phases.split(",")) <= {"ipc", "overhead"}
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("ROLLQ_ENGINE_GPU", "0" if alone else "1")
    asyncio.run(engine_main(a))


if __name__ == "__main__":
    main()
