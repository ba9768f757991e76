"""Tests of ``fp8_lightning/data/``, and the text of their tiny prepared dataset."""

TEXT_A = "To be, or not to be, that is the question:\n" * 60
TEXT_B = "Whether 'tis nobler in the mind to suffer\n" * 60
# A file each, of different sizes (a schedule sorted by size would reorder them), for the prepares
# with two workers (tests._runs.two_worker_prepare)
PARTS = (TEXT_A, TEXT_B, "Ay, there's the rub;\n" * 90, "For in that sleep of death\n" * 30,
         "Must give us pause\n" * 120, "The slings and arrows\n" * 45)
