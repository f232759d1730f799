"""The one exception type for bad input: it carries a message that names the file, key or value at fault."""


class PipelineError(Exception):
    """Raised for bad input or missing resources; the CLI prints its message alone and exits 2."""
