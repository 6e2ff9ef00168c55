"""The one error type conversion raises for bad input; the CLI prints it without a traceback."""


class ConversionError(ValueError):
    """A checkpoint, config or option cannot be converted exactly; the message says why."""
