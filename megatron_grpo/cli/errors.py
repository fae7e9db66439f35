"""User errors end the command with one clear line and a non-zero exit, no traceback."""

from __future__ import annotations

import contextlib
import sys

from megatron_grpo.config import ConfigError


@contextlib.contextmanager
def exit_on_user_error():
    """Turn configuration and input errors into ``error: <message>`` and exit code 2."""
    from megatron_grpo.models.spec import UnsupportedModelError
    from megatron_grpo.trainer.loop import RolloutFailure

    try:
        yield
    except (ConfigError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RolloutFailure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
