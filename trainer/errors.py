"""One exception type for input a user can fix; train.py prints it as a single line."""


class ConfigError(ValueError):
    """Bad configuration or input. The message names the value and what would be valid."""


class NotResumable(ConfigError):
    """The checkpoint is sound but this run's config or data cannot continue it: refused,
    not skipped for an older checkpoint (which would have the same values)."""


class Damaged(ConfigError):
    """A checkpoint file is missing, truncated or fails its checksum: the checkpoint can
    never load. resume=auto sets such a checkpoint aside and takes the one before it."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names the step."""


class PeerError(TrainingError):
    """Another rank stopped answering or died; every rank that notices says so."""
