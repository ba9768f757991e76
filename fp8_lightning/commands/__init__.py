"""The commands besides Lightning's ``fit``/``validate``/``test``/``predict`` (:mod:`fp8_lightning.cli`
dispatches them): one module each, plus the run-config helpers ``bench`` and ``doctor`` share."""
