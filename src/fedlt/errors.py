"""Errors that the command line turns into one line on stderr and exit status 2."""


class FedltError(Exception):
    """A problem with the user's input: a bad setting, an unknown name, a missing or corrupt file.

    The message is one line that says what is wrong and how to fix it.
    """


class ConfigError(FedltError):
    """An impossible or unknown setting."""


class DataError(FedltError):
    """A data file that is missing or corrupt."""
