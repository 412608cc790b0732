"""``rollq redis``: an embedded redis-server (or a local cluster) until stopped."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .common import log, out


def cmd_redis(a: argparse.Namespace) -> int:
    import signal

    from ..server import LocalCluster, RedisServer

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the server(s) as Ctrl-C does

    signal.signal(signal.SIGTERM, _interrupt)
    if a.cluster:
        if a.port or a.dir:
            log.error("--cluster picks its own ports and a temporary directory: drop --port/--dir")
            return 2
        cluster = LocalCluster(masters=a.cluster).start()
        out({"url": cluster.url, "nodes": [n.url for n in cluster.nodes], "formed_with": cluster.formed_with}) if a.json else print(cluster.url, flush=True)
        try:
            while all(n.proc and n.proc.poll() is None for n in cluster.nodes):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.cleanup()
        return 0
    srv = RedisServer(port=a.port, data_dir=a.dir, appendfsync=a.appendfsync).start()
    pid = srv.proc.pid if srv.proc is not None else None
    out({"url": srv.url, "pid": pid, "data_dir": srv.data_dir}) if a.json else print(srv.url, flush=True)
    try:
        while srv.proc and srv.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0

def register(sub: Any) -> None:
    """Add redis to the ``rollq`` subcommands."""
    s = sub.add_parser("redis", help="run an embedded redis-server and print its URL")
    s.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    s.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    s.add_argument("--appendfsync", default="everysec", choices=["always", "everysec", "no"],
                   help="AOF fsync policy (default: %(default)s). always: nothing acknowledged is lost "
                        "even if the machine crashes, every write waits for the disk; everysec: a killed "
                        "redis-server loses nothing the kernel has, a machine crash up to ~2 s of writes; "
                        "no: a machine crash loses what the kernel had not flushed (~30 s). README: Durability")
    s.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="a local Redis Cluster of N masters instead (prints its redis+cluster:// URL)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_redis)
