"""The ``rollq`` command line: one module per command group, put together in :mod:`.main`."""
