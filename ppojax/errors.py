"""The errors every layer of ppojax raises for a user's mistake or an unusable input. Each message names the value,
what was expected and the fix; ``ppojax train`` prints it as one line (``ppojax: error: ...``), never a traceback.
This module imports nothing of ppojax: any layer may raise these."""
import signal


class ConfigError(ValueError):
    """A bad configuration value; the message names the value, what was expected and the fix."""


class RunDirError(ConfigError):
    """output_dir cannot be used as asked; the message names the directory and the choices."""


class ModelLoadError(ValueError):
    """A checkpoint directory or `config.json` that cannot be loaded; the message names the file, the value and
    what is expected."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture or options ppojax does not implement (loading it would diverge from
    transformers, so it is refused)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here, or a save that failed; the message says why and what to do."""


class ExportDirError(ValueError):
    """An export's target directory holds something that is not a ppojax export."""


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than B finite numbers."""


class EnvironmentCallError(ValueError):
    """An environment's ``reset`` or ``step`` raised or returned something unusable; the message names the
    environment class, the method and the dataset row. (A tool's failure is an observation, never this.)"""


class CpuFeatureMissing(ValueError):
    """A CPU-specific path was asked for on a CPU that lacks its instruction sets (the message says which and
    what to use instead)."""


class RunInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run between updates; a checkpoint of the last update was written."""

    def __init__(self, signum: int, update: int, checkpoint):
        self.signum, self.update, self.checkpoint = signum, update, checkpoint
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after update {update}; checkpoint {checkpoint} written. Continue "
                         "with resume=auto.")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for a process ended by a signal
