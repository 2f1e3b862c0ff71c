"""The one exception type the dooly CLI turns into a one-line error and a non-zero exit."""


class DoolyError(Exception):
    """An expected failure (bad config, missing profile): reported as one line, no traceback."""


def one_line(exc: BaseException, lines: int = 1) -> str:
    """Another library's exception as one line for a DoolyError: its type and its first ``lines`` non-empty
    lines, at most 300 characters."""
    text = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' '.join(text[:lines])}"[:300] if text else type(exc).__name__
