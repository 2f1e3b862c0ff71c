"""Commands registered on the dooly app (filled in by its feature)."""
