"""Weight sync inside each vLLM worker process: the worker extension vLLM loads
(:mod:`.ext`, ``rollq.weightsync.worker.ext.RollqWorkerExtension``) is its one public module.

Modules named with a leading underscore are internal: the worker's state, the broadcast
receiver and its offer listener, memmap staging, the shadow weights, the swap and its kernel,
request progress, and the ``load_weights`` trace.
"""
