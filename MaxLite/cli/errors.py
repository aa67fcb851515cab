"""Errors MaxLite reports to the user as a single line (no traceback); `cli.run` prints them."""


def first_line(error: BaseException, with_type: bool = False, limit: int = 240) -> str:
  """An exception's first line of text, at most `limit` characters (libraries' messages run to many
  lines), prefixed with its type name when asked or when it has no text."""
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  if with_type or not text:
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return text if len(text) <= limit else text[: limit - 3] + "..."


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


class UsageError(MaxLiteError):
  """A command line that does not parse: an unknown flag, a missing required one, a bad value."""
