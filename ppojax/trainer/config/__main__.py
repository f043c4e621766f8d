"""``python -m ppojax.trainer.config > docs/configuration.md``: the configuration reference, generated."""
import sys

from ppojax.trainer.config.help import configuration_markdown

if __name__ == "__main__":
    sys.stdout.write(configuration_markdown())
