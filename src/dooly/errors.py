"""The one exception type the dooly CLI turns into a one-line error and a non-zero exit."""


class DoolyError(Exception):
    """An expected failure (bad config, missing profile): reported as one line, no traceback."""
