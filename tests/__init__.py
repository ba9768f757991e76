"""fp8-lightning's tests: laid out as the package is (``tests/commands/`` for ``fp8_lightning/commands/``, ...);
the GPU tests (``test_gpu_*.py``, ``-m gpu``) are grouped by capability."""
