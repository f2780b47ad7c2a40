"""ONNX export of the decoder graph, and an ONNX Runtime backend behind the same Graph interface."""
