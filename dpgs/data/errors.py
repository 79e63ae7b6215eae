"""The one exception of the data layer: every input problem found, listed at once."""

from __future__ import annotations


class DataValidationError(ValueError):
    """Bad inputs. ``problems`` holds one line per problem, each naming the file, row or column."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} input problem{'s' if n != 1 else ''} found:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))
