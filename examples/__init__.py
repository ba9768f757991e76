"""Examples a user runs as scripts (``python examples/own_model.py``); a package too, so that the
benchmarks and tests import them by name (``from examples import own_model``)."""
