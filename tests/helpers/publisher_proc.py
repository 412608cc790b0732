"""A trainer that publishes one policy version, in its own process, for tests that kill it
mid-publish (rollq's real path: :meth:`~rollq.weightsync.trainer.publisher.WeightPublisher.publish_weights`
over memmap, a one-tensor state dict, unchecked).

    python -m tests.helpers.publisher_proc URL QUEUE ROOT VERSION

Exits 0 once the version is committed and mirrored into every shard.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from rollq.weightsync.trainer.publisher import WeightPublisher


async def main(url: str, queue: str, root: str, version: int) -> int:
    pub = WeightPublisher(url, queue, root=root, validate=False, trainer_id="publisher_proc")
    try:
        await pub.publish_weights({"w": torch.zeros(4)}, version=version, transport="memmap")
    finally:
        await pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
