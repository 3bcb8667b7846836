"""Write the option tables of docs/conformance.md from the parsers themselves.

``python tools/options_doc.py`` rewrites the tables between the ``<!-- options:NAME -->``
markers: ``attnref audit``'s options from the CLI's own parser, the pytest plugin's from
its ``pytest_addoption`` (both declare the shared ones through
`attnref.conformance.options.add_audit_options`, the one definition). ``--check`` exits
1 when the page is out of date (a default-tier test runs it), so an option cannot be
added without its line in the docs.
"""

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


def _row(flags: list[str], kwargs: dict[str, Any]) -> str:
    names = ", ".join(f"`{f}`" for f in flags)
    if kwargs.get("action") == "append":
        names += " (repeatable)"
    text = " ".join(str(kwargs.get("help", "")).replace("%%", "%").split())
    choices = kwargs.get("choices")
    if choices:
        text += f" One of {', '.join(f'`{c}`' for c in choices)}."
    return f"| {names} | {text.replace('|', '/')} |"


def audit_rows() -> list[str]:
    """``attnref audit``'s options, from the CLI's parser."""
    from attnref.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    audit = sub.choices["audit"]
    rows = []
    for action in audit._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kwargs: dict[str, Any] = {"help": action.help, "choices": action.choices}
        if isinstance(action, argparse._AppendAction):
            kwargs["action"] = "append"
        rows.append(_row(list(action.option_strings), kwargs))
    return rows


def plugin_rows() -> list[str]:
    """The pytest plugin's options, from its ``pytest_addoption``."""
    from attnref.pytest_plugin import pytest_addoption

    rows: list[str] = []

    class Group:
        def addoption(self, *flags: str, **kwargs: Any) -> None:
            rows.append(_row(list(flags), kwargs))

    class Parser:
        def getgroup(self, *args: Any) -> Group:
            return Group()

    pytest_addoption(Parser())  # type: ignore[arg-type]
    return rows


TABLES = {"audit": audit_rows, "plugin": plugin_rows}


def _filled(table: str) -> Callable[[re.Match[str]], str]:
    def fill(m: re.Match[str]) -> str:
        return m.group(1) + table + "\n" + m.group(2)

    return fill


def render(text: str) -> str:
    """``text`` with every marked table rebuilt."""
    for name, rows in TABLES.items():
        table = "\n".join(["| option | meaning |", "|---|---|", *rows()])
        pattern = re.compile(rf"(<!-- options:{name} -->\n).*?(<!-- /options:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{PAGE}: no <!-- options:{name} --> markers")
        text = pattern.sub(_filled(table), text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    text = PAGE.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is out of date: run python tools/options_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
