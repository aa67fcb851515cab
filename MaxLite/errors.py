"""Errors MaxLite reports to the user as a single line (no traceback)."""


class MaxLiteError(Exception):
  """Base class: anything the user can fix by changing input."""


class ConfigError(MaxLiteError):
  """A config key, value or combination is invalid."""


class InputError(MaxLiteError):
  """A data file, tokenizer or other input is missing or unreadable."""


class CheckpointError(MaxLiteError):
  """A checkpoint is missing, unreadable or does not fit the configured model."""


class LaunchError(MaxLiteError):
  """A pod launch cannot start: a bad flag value, gcloud missing, or a TPU slice not found."""


def run_command(entry_point, *args) -> int:
  """Run a command-line entry point: its MaxLiteError becomes one `error:` line and exit code 2."""
  import sys  # pylint: disable=import-outside-toplevel
  try:
    result = entry_point(*args)
  except MaxLiteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return result if isinstance(result, int) else 0
