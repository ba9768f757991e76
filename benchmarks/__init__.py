"""The benchmarks behind docs/benchmarks.md: the plain PyTorch baseline (``plain_pytorch.py``), a
user's model under the plugin (``own_model.py``) and the job harness (``python -m
benchmarks.harness``) with its summary (``benchmarks.summary``)."""
