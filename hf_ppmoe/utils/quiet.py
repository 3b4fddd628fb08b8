"""Notices other libraries print around our commands that tell the user nothing about what the command does, dropped
where they are logged (a filter on the library's logger, for that one message): `quiet_notices()` runs at the start of
every `hf-ppmoe` command and `python -m hf_ppmoe.training`, never on `import hf_ppmoe` (a library does not silence
other libraries in its user's process). Standard library only.

- DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.": logged
  when DeepSpeed is imported on a machine without a GPU, which happens whenever DeepSpeed is installed (Transformers'
  `save_pretrained` and Accelerate's `unwrap_model` import it to ask whether ZeRO-3 runs). Kept when Accelerate runs
  the job with DeepSpeed (`accelerate launch --use_deepspeed` sets ACCELERATE_USE_DEEPSPEED), where the accelerator
  DeepSpeed picks matters.

`dropped(logger, start)` drops one notice for a block: torch's "While redistributing from (_StridedShard(...),
Shard(...)) to (Replicate(), Replicate()), 2 sequential all_gather operations will be performed. This is suboptimal
..." when a model split by FSDP and tensor parallelism is gathered once, for saving (training/parallel_setup.py); a
hint for collectives that repeat every step.

Accelerate's "Removed shared tensor {...} while saving" is avoided at its cause instead (training/checkpoints.py:
`drop_tied_copies`).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU."


class DropNotice(logging.Filter):
    """Drops the records of one logger whose message starts with `start`."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def quiet_notices() -> None:
    """Drop the notices above for the rest of this process (a command's)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in ("1", "true", "yes"):
        # DeepSpeed configures this logger when it is imported; a filter set before stays
        logger = logging.getLogger("DeepSpeed")
        if not any(isinstance(f, DropNotice) and f.start == DEEPSPEED_CPU_NOTICE for f in logger.filters):
            logger.addFilter(DropNotice(DEEPSPEED_CPU_NOTICE))


@contextmanager
def dropped(logger: str, start: str):
    """Drop the records of `logger` whose message starts with `start`, for the block."""
    notice = DropNotice(start)
    logging.getLogger(logger).addFilter(notice)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(notice)


__all__ = ["DropNotice", "dropped", "quiet_notices"]
