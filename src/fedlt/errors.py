"""Errors that the command line turns into one line on stderr and an exit status (2 for bad input, 3 for a
run that diverged, 75 for a deployed run that lost its SuperLink)."""


class FedltError(Exception):
    """A problem with the user's input: a bad setting, an unknown name, a missing or corrupt file.

    The message is one line that says what is wrong and how to fix it.
    """

    exit_status = 2


class ConfigError(FedltError):
    """An impossible or unknown setting."""


class DataError(FedltError):
    """A data file that is missing or corrupt."""


class Diverged(FedltError):
    """Training went non-finite (or the loss grew past the set multiple of its first value): the run stopped,
    its summary says ``diverged``. The message names the round, the method and what to try."""

    exit_status = 3


class Interrupted(FedltError):
    """A deployed run lost its SuperLink (the machine or the process died): nothing is wrong with the input, the
    run is checkpointed (its message says which round) and resumes with ``--resume`` once the SuperLink is back.
    Exit status 75, ``EX_TEMPFAIL`` of sysexits.h: a temporary failure, try again."""

    exit_status = 75
