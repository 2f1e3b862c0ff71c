"""The trace layer: tracing a model through an engine into operator signatures (signature, taint, tracer)."""
