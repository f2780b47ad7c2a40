"""Checkpoint tools behind the CLI: convert, synth, bench, inspect."""
