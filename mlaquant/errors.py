"""Error types users see as one line from the CLI."""


class MLAQuantError(Exception):
    """A problem with user input (path, checkpoint, config, plan); the message names it."""


class CheckpointError(MLAQuantError):
    """A checkpoint directory, config or tensor that cannot be loaded as an MLA model."""


class PlanError(MLAQuantError):
    """A plan that is malformed or does not belong to the model it is used with."""


class BackendError(MLAQuantError):
    """An explicitly requested compute backend that cannot run here."""


class DeviceError(MLAQuantError):
    """A --device / --dtype that cannot be used here, or a device that ran out of memory."""
