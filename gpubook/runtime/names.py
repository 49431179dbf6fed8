"""Name rules, in one place: user and template names end up in container names, paths and ssh lines.

Strict and ASCII only (no look-alikes after NFKC): the config, the booking parser, the data
folders and the template loader all check against these patterns and say the same sentence.
"""

from __future__ import annotations

import re

USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
TEMPLATE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")

USER_NAME_RULE = ("lower-case ASCII letters, digits, '_' and '-', starting with a letter or '_', "
                  "at most 32 characters")
TEMPLATE_NAME_RULE = "lower-case ASCII letters, digits, '.', '_' and '-', at most 64 characters"


def user_name_problem(name: str) -> str | None:
    """None for a valid user name, else what is wrong with it."""
    return None if USER_NAME.fullmatch(name) else f"is not a valid user name ({USER_NAME_RULE})"


def template_name_problem(name: str) -> str | None:
    """None for a valid template name, else what is wrong with it."""
    return None if TEMPLATE_NAME.fullmatch(name) else f"is not a valid template name ({TEMPLATE_NAME_RULE})"
