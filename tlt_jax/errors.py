"""User-facing errors: one line that names the file, flag or field and what is wrong.

CLIs catch `UserInputError`, print its message on one line and exit with code 2.
"""


class UserInputError(ValueError):
  """Bad input a user can fix: a missing file, a malformed tensor, an unknown option."""
