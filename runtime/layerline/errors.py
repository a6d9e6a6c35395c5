"""The one exception family a user sees: a single line naming the field and the fix."""


class LayerlineError(Exception):
    """A user-facing error; its message is one line that names the field and what to do."""
