"""StructuredOutputs: what one request constrains its output to. Plain data only (strings and lists),
so that it crosses a process boundary with the rest of SamplingParams; the compiled grammar never does."""
from __future__ import annotations

import json
from dataclasses import dataclass

# Bounds on what one request may make the grammar compiler chew on (also in README's limits).
MAX_SCHEMA_CHARS = 65536
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 65536
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
_FORMS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputs:
    """Exactly one of json (a JSON Schema, as JSON text), regex, choice, grammar (EBNF) or json_object.

    enable_after: token ids that end the model's reasoning (e.g. `</think>`); when set, the output is free
    until that sequence has been generated and constrained after it. None: constrained from the first token.
    """
    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    enable_after: list[int] | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            self.json = json.dumps(self.json)      # a schema given as a dict (offline API convenience)
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.enable_after is not None:
            self.enable_after = [int(t) for t in self.enable_after]
        self.validate()

    @property
    def form(self) -> str:
        return next(f for f in _FORMS if getattr(self, f) not in (None, False))

    def validate(self) -> None:
        given = [f for f in _FORMS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar or json_object; "
                             f"got {', '.join(given) or 'none'}.")
        _check_text("json schema", self.json, MAX_SCHEMA_CHARS)
        _check_text("regex", self.regex, MAX_REGEX_CHARS)
        _check_text("grammar", self.grammar, MAX_GRAMMAR_CHARS)
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"choice must hold 1 to {MAX_CHOICES} strings, got {len(self.choice)}.")
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise ValueError(f"each choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters.")
        if self.enable_after is not None and not self.enable_after:
            raise ValueError("enable_after must name at least one token id.")

    def key(self) -> tuple:
        """What the compiled grammar depends on (enable_after does not change the grammar)."""
        return (self.form, self.json, self.regex, tuple(self.choice or ()), self.grammar)


def _check_text(name: str, value: str | None, limit: int) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"the {name} must be a non-empty string.")
    if len(value) > limit:
        raise ValueError(f"the {name} is {len(value)} characters long; at most {limit} are accepted.")
