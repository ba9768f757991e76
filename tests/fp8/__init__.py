"""Tests of ``fp8_lightning/fp8/``."""
