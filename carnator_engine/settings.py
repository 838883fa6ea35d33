"""The user-facing settings' names and defaults, importable without torch: the command line answers --help and
refuses a bad argument before it loads torch (seconds on a small machine)."""

RISK_LEVELS = ("safe", "balanced", "aggressive")
DEFAULT_SIZE_LIMIT = 8 << 30    # bytes: a cache's size limit unless one is given (the Carnator Cache node, the CLI)
