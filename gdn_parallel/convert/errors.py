"""The one error a conversion raises for what the user can fix (a path, a flag, a config, a folder
the target format cannot express); the command line prints it and exits with status 2."""
from __future__ import annotations


class ConvertError(ValueError):
    """A conversion cannot be done as asked; the message says what differs and the fix."""
