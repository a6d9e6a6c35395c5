"""The one exception family a user sees: a single line naming the field and the fix."""


class LayerlineError(Exception):
    """A user-facing error; its message is one line that names the field and what to do.

    `code` lets programs tell kinds apart (e.g. "seq_unknown": a stage lost a sequence's cache).
    """

    def __init__(self, message: str = "", code: str | None = None):
        super().__init__(message)
        self.code = code


class CheckpointError(LayerlineError):
    """A checkpoint is missing, malformed or of an unsupported kind (here, below both
    layerline.checkpoint and layerline.text, so neither imports the other for it)."""
