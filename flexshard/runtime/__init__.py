"""What a training step runs through: bucket storage and layouts, the gather and
reduce of each bucket, forward hooks, prefetch, gradient reduction, reshard."""
