"""The serve layer: real serving runs (HF, vLLM) to validate the simulator against."""
