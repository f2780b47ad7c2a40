"""ONNX export of the decoder graph, and an ONNX Runtime backend behind the same Graph interface.

Only names live here (no onnx import), so the loader can tell an export folder by its manifest."""

MANIFEST = "onnx.json"  # what an export folder holds (`export.read_manifest`)
