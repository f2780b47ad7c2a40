"""What runs a model: KV caches, the engine step, sampling, the generation loop."""
