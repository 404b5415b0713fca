"""The exception for bad user input: the CLI prints it as one message, never a traceback."""

# `dstrain train`'s exit code when a step ran out of device or host memory (`train/oom.py`):
# none other uses it (1: wrong input or a failed run, 2: unreadable input, 128 + N: signal N).
OUT_OF_MEMORY = 3


class UserError(Exception):
    """Bad input (config, flag, file, environment). `fix` tells the user what to do instead.

    `exit_code` follows `dstrain check`: 1 for an input that was read but is wrong, 2 for an input
    that cannot be read at all (missing file, broken syntax).
    """

    def __init__(self, message: str, fix: str = "", exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.fix}" if self.fix else self.message
