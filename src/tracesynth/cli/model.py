"""Commands registered on the tracesynth app (filled in by its feature)."""
