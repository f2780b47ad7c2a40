"""Gemma text decoders (Gemma 4 E-series, Gemma 3): config, tensor contract, graph, weight building."""
