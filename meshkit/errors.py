"""The one base of meshkit's input errors: each message is one line naming what is wrong and what to change."""


class MeshkitError(ValueError):
    """Bad input or wrong use. The command line prints these as one line (exit code 2), never a traceback."""
