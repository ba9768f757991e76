"""The Lightning callbacks: the console/logging monitor, the NaN guard, its fault-injection
drill, the checkpoint callback and the step profile (``FP8Stats`` lives with the FP8 component, :mod:`fp8_lightning.fp8.stats`)."""
