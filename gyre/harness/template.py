"""Command templates: argv lists whose elements may hold `{placeholder}`s, expanded without a shell.

Each element expands to exactly one argument, so a prompt with spaces or quotes stays one argument and
nothing is ever shell-interpreted. `{{` and `}}` are literal braces. Only plain names are allowed (no
`{x.y}`, `{x[0]}`, `{x!r}` or `{x:>5}`): a template is configuration, not code.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping, Sequence

from gyre.harness.errors import TemplateError

_FORMATTER = string.Formatter()


def placeholders(template: str, *, where: str) -> list[str]:
    """The placeholder names in `template`, in order; a `TemplateError` for unsupported syntax."""
    try:
        parsed = list(_FORMATTER.parse(template))
    except ValueError as e:
        raise TemplateError(f"{where}: bad template {template!r}: {e}") from e
    names = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise TemplateError(
                f"{where}: placeholder {{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} in {template!r} is not a plain name; "
                "write {name} (and {{ or }} for a literal brace)"
            )
        names.append(name)
    return names


def check_templates(templates: Iterable[str], known: Iterable[str], *, where: str) -> None:
    """Fail early, at configuration time, on a placeholder that expansion would not know."""
    allowed = set(known)
    for template in templates:
        for name in placeholders(template, where=where):
            if name not in allowed:
                raise TemplateError(
                    f"{where}: unknown placeholder {{{name}}} in {template!r}; "
                    f"known placeholders: {', '.join('{' + k + '}' for k in sorted(allowed))}"
                )


def expand(template: str, values: Mapping[str, str], *, where: str) -> str:
    """`template` with every placeholder replaced by its value."""
    check_templates([template], values, where=where)
    return template.format_map(values)


def expand_all(templates: Sequence[str], values: Mapping[str, str], *, where: str) -> list[str]:
    return [expand(t, values, where=where) for t in templates]
