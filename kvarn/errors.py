"""User-facing errors: the CLI prints them as one line on stderr and exits 2, never a traceback."""


class KvarnError(Exception):
    """Bad input or an unusable environment, worded for the user (name the value and what is accepted)."""

    exit_code = 2


def choices(values) -> str:
    return ", ".join(str(v) for v in values)
