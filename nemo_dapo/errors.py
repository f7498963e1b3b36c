"""The errors the command line reports as a message alone, without a traceback.

:class:`InputError`: bad input (a config, a dataset file or row, a model folder or file),
raised with a message that names the field (or file and row) and the fix; exit 2, the code a
batch script never requeues (retrying cannot fix the input). :class:`RemoteCallError`: a worker
process died or hung; exit 1, which the batch script requeues a bounded number of times (the
run resumes from its last checkpoint). Anything else is a crash, with its traceback.
"""


class InputError(Exception):
    """Something the user gave is wrong; the message says what and how to fix it."""


class ConfigError(InputError, ValueError):
    """A config that cannot run; the message lists every problem found."""


class RemoteCallError(RuntimeError):
    """A worker that died, or gave no answer in time, during a call the driver waits on. The
    message names the group, the call, the ranks and where their logs are."""


class EngineFailure(RuntimeError):
    """The engine inside a live rollout worker failed while stepping (an error in the model's
    forward or the device, a dead tensor-parallel worker, vLLM's ``EngineDeadError``, its
    stepping thread stopped): the driver replaces the worker as if it had died."""


class GenerationStopped(Exception):
    """A stop (SIGUSR1 / SIGTERM) came while the driver waited for a generation: the wait ends at
    once and the caller gives up what was being generated; the engines' calls are left to finish
    or to die with the run (a stopping run uses its engines no more)."""


class TrainingDiverged(RuntimeError):
    """Optimizer steps with a non-finite gradient, ``trainer.max_nonfinite_steps`` training steps in
    a row: the run stops before checkpointing them. The message says which steps and what to look at."""
