"""``python -m rollq.rl._host_main SOCKET``: the process :class:`~rollq.rl.replica_host.ReplicasProcess`
starts to host an RL run's replicas (a module of its own, so that the one it runs is not also
imported as part of :mod:`rollq.rl`)."""

import sys

from rollq.rl.replica_host import main

if __name__ == "__main__":  # vLLM's engine cores are started with multiprocessing: this guard is needed
    sys.exit(main())
