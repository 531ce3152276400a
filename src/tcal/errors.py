"""The errors a user fixes in their input rather than in the code; `tcal` prints them on one line (exit code 2)."""


class ConfigError(ValueError):
    """A setting the run cannot use; raised before any work, so the run directory stays empty."""


class DataError(ConfigError):
    """Text the run cannot read (empty, not UTF-8, a bad jsonl line); names the file and the line."""


class HubUnavailable(ConnectionError, ConfigError):
    """A hub resource the run cannot reach (offline, not cached); both a connection and a configuration error."""
