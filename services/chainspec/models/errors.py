"""Errors raised while reading checkpoints and configurations."""


class CheckpointError(ValueError):
    """A checkpoint directory, file, tensor or config does not fit the model.

    The message names the file and, where there is one, the tensor.
    """
