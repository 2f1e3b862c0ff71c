"""The core layer: errors, numbers, the request/batch entities, byte units, config digests and the model zoo.

Everything else in dooly may import from here; nothing here imports from another dooly layer.
"""
