"""The one exception type users see: a message that says what was wrong and what to do."""


class PipeswapError(Exception):
    """Bad input or an impossible request; the message names the fix.

    The CLI prints the message and exits with status 2 instead of a traceback.
    """
