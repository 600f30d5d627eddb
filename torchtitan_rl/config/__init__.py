"""The job's config, in one home: the TOML loader and `--section.key=value` overrides
(`loader`), the job-wide sections (`job`: job, parallelism, validation, checkpoint;
`launcher`: which hosts) and `--help` (`help`). Every other section is owned by its
component, next to its code; this package only composes them and imports nothing from the
controller.
"""

from torchtitan_rl.config.help import help_text
from torchtitan_rl.config.loader import Config, ConfigError, load_config, to_toml

__all__ = ["Config", "ConfigError", "help_text", "load_config", "to_toml"]
