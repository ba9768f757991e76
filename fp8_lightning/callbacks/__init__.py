"""The Lightning callbacks: the console/logging monitor, the NaN guard, its fault-injection
drill and the checkpoint callback (``FP8Stats`` lives with the FP8 component, :mod:`fp8_lightning.fp8.stats`)."""
