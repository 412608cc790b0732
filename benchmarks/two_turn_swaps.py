"""Where the lag-0 logprob disagreement of two-turn episodes comes from, turn by turn.

    python benchmarks/two_turn_swaps.py [--steps 60] [--replicas 2] [--seed 0]

Runs the async loop on :class:`~rollq.rl.tasks.TwoTurnTask` (the recipe of ``rollq demo
--task two_turn``: 16 groups x 8 episodes, lr 5e-3, max lag 1, memmap) with a trainer that,
before each step, recomputes every token the replicas marked with the trainer's current
version ``v`` at ``v`` and, for the turns that a swap split (job span ``(v-1, v)``), at
``v - 1`` too. Prints one JSON object: the run's figures and ``{category: {tokens, mean, max}}``
of |behavior - trainer| by turn and by whether the turn's job ran at one version ("fresh") or
across the swap ("span", with the token's index in the turn). Where the swaps land depends on
timing (two replicas and the trainer share the cores), so runs differ in how many they see.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: kind -> [tokens, sum, max] of |behavior - trainer| (filled by the probe trainer).
_CATS: dict[str, list[float]] = {}


def _trainer_class() -> Any:
    import torch

    from rollq.rl import GrpoTrainer
    from rollq.rl.behavior import token_logprobs

    class Probe(GrpoTrainer):
        """A trainer that files each current-version token's |behavior - trainer| by turn kind."""

        def step_episodes(self, groups: Any, rewards: Any) -> Any:
            eps = [e for g in groups for e in g]
            prompts = [e.token_ids[: e.prompt_len] for e in eps]
            rest = [e.token_ids[e.prompt_len :] for e in eps]
            with torch.no_grad():
                now, _ = token_logprobs(self.model, prompts, rest)
                old_w = self.weights_at(self.version - 1)
                old = None if old_w is None else token_logprobs(self.model, prompts, rest, old_w)[0]
            for i, e in enumerate(eps):
                for t, s in enumerate(e.turns):
                    fresh = s.version_start == s.version_end == self.version
                    for pos in range(s.start, s.end):
                        if e.versions[pos] != self.version:
                            continue
                        kind = f"turn {t + 1} fresh" if fresh else f"turn {t + 1} span token {pos - s.start}"
                        self._file(kind + " vs v", abs(float(now[i, pos - e.prompt_len]) - e.logprobs[pos]))
                        if not fresh and old is not None:
                            self._file(kind + " vs v-1", abs(float(old[i, pos - e.prompt_len]) - e.logprobs[pos]))
            return super().step_episodes(groups, rewards)

        def _file(self, kind: str, d: float) -> None:
            c = _CATS.setdefault(kind, [0, 0.0, 0.0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + d, max(c[2], d)

    return Probe


async def main(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from rollq.rl import GrpoConfig, LoopConfig, Replicas, run_loop
    from rollq.rl.tasks import TwoTurnTask
    from rollq.server import RedisServer
    from rollq.testing.tiny_model import ensure_tiny_model
    from rollq.weightsync import WeightPublisher

    torch.set_num_threads(1)
    model = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    root = tempfile.mkdtemp(prefix="rollq-two-turn-")
    try:
        with RedisServer() as srv:
            replicas = Replicas(srv.url, "two-turn", weights_root=root, count=a.replicas, model=model)
            await replicas.start()
            try:
                trainer = _trainer_class().from_pretrained(model, GrpoConfig(lr=5e-3), seed=a.seed)
                pub = WeightPublisher(srv.url, "two-turn", root=root, keep=4)
                rec = await pub.publish_weights(trainer.state_dict())
                trainer.rebase(rec.version)
                await replicas.wait_version(rec.version)
                report = await run_loop(srv.url, "two-turn", trainer, TwoTurnTask(vocab_size=len(tokenizer)), tokenizer, pub,
                                        LoopConfig(steps=a.steps, seed=a.seed))
                await pub.close()
            finally:
                await replicas.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s = report.summary()
    out = {k: s[k] for k in ("reward_first", "reward_last", "wall_s", "spanning_samples", "swap_token_share",
                             "logprob_abs_diff_by_lag")}
    out["current_version_tokens"] = {k: {"tokens": int(n), "mean": t / n, "max": m}
                                     for k, (n, t, m) in sorted(_CATS.items())}
    return out


if __name__ == "__main__":  # vLLM's engine core is spawned: the guard is needed
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(main(ap.parse_args()))))
