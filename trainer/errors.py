"""The exceptions train.py prints as one line: ConfigError for input a user can fix (and
its kinds), TrainingError when training cannot go on."""


class ConfigError(ValueError):
    """Bad configuration or input. The message names the value and what would be valid."""


class NotResumable(ConfigError):
    """The checkpoint is sound but this run's config or data cannot continue it: refused,
    not skipped for an older checkpoint (which would have the same values)."""


class Damaged(ConfigError):
    """A checkpoint's bytes are proven wrong: a file fails its checksum, does not unpickle,
    ends early, has another size than its index says, or no rank finds it. The checkpoint
    can never load: resume=auto sets it aside and takes the one before it. A read that
    fails for the storage's sake is a StorageError instead ([Note: storage errors are not
    damage] in trainer/checkpoint/storage.py)."""


class Missing(Damaged):
    """A checkpoint file this rank does not find (ENOENT). Damage when no rank finds it; a
    storage error when another rank does (resume decides, over every rank's view)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names the step."""


class StorageError(TrainingError):
    """A checkpoint file could not be read although nothing shows its bytes wrong: an
    OSError of the storage (EIO, ESTALE, EACCES) after a few attempts, or a file that one
    rank does not find while another does. The resume fails on every rank with one line
    naming the file and the errno; nothing on disk is renamed or removed. Also: the file
    mode.offload=disk keeps state in could not be reserved, read or written, or changed
    under the run (trainer/offload/disk.py)."""


class PeerError(TrainingError):
    """Another rank stopped answering or died; every rank that notices says so."""


def is_collective_timeout(error: BaseException) -> bool:
    """Whether a collective's error says it waited past its timeout: Gloo's "timed out"
    in the waiting rank, or NCCL's watchdog ("caught collective operation timeout", the
    communicator aborted; [Note: NCCL timeouts] in trainer/run/dist.py)."""
    text = str(error).lower()
    return "timed out" in text or "watchdog caught collective operation timeout" in text


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
