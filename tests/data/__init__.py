"""Tests of ``fp8_lightning/data/``, and the text of their tiny prepared dataset."""

TEXT_A = "To be, or not to be, that is the question:\n" * 60
