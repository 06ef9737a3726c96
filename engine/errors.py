"""User-facing errors.

Anything raised as a `DsctlError` is a problem with the user's input or
environment (bad flag, missing checkpoint file, prompt too long): the CLI prints
its message on one line and exits non-zero, without a traceback.
"""


class DsctlError(Exception):
    """An error whose message is meant for the operator, not a bug."""

    exit_code = 2


class UsageError(DsctlError):
    """A bad flag value or a bad combination of flags."""


class ConfigError(DsctlError):
    """A config.json that is not a supported DeepSeek model or lacks a field."""


class CheckpointError(DsctlError):
    """A checkpoint directory that is missing files or has unreadable shards."""


class RequestError(DsctlError):
    """A request the engine cannot serve (prompt too long, bad token ids, ...)."""


class GpuMemoryError(DsctlError):
    """The GPU's memory does not hold what the flags ask of it (said with the flags that would fit)."""
