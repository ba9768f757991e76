"""Tests of ``fp8_lightning/callbacks/``."""
