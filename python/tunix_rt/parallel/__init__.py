"""Device meshes, partition rules and multi-process setup for training."""
