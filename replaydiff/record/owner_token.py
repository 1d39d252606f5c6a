"""Which recording this process belongs to: the token it claims a trace directory with (``trace/ownership.py``).

Every process of one recording must carry the same token, so that they share the directory and a second recording
is refused: the children of ``replaydiff record`` get the CLI's token through the step hook's settings; the ranks of
a job launched by torchrun (or with its variables) share the job's rendezvous (run id, master address and port, which
two jobs running at once cannot share), ranks spawned by one parent share it; a process on its own gets a token of its own for each recording.
"""
from __future__ import annotations

import json
import os
import socket
import uuid

from replaydiff.record.autostart._replaydiff_record_env import ENV_VAR

OWNER_KEY = "owner"  # the token's key in the step hook's settings (ENV_VAR)


def recording_token(world_size: int) -> str:
    """The token of the recording this process is part of (``world_size``: of its job, from torch.distributed)."""
    try:
        armed = json.loads(os.environ.get(ENV_VAR) or "{}")
        if isinstance(armed, dict) and isinstance(armed.get(OWNER_KEY), str):
            return armed[OWNER_KEY]
    except ValueError:
        pass
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size > 1 and addr and port:
        return f"job {os.environ.get('TORCHELASTIC_RUN_ID', '')}@{addr}:{port}"
    if world_size > 1:  # ranks started by one parent (torch.multiprocessing.spawn) on one host
        return f"job {socket.gethostname()}:{os.getppid()}"
    return new_token()


def new_token() -> str:
    return uuid.uuid4().hex
