"""The one error type for bad input: a config, a dataset file or row, a model folder or file.

Raised with a message that names the field (or file and row) and the fix; the command line
prints that message alone and exits 2, the code a batch script never requeues (retrying
cannot fix the input). Anything else is a crash, with its traceback.
"""


class InputError(Exception):
    """Something the user gave is wrong; the message says what and how to fix it."""


class ConfigError(InputError, ValueError):
    """A config that cannot run; the message lists every problem found."""
