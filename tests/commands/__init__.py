"""Tests of ``fp8_lightning/commands/``."""
