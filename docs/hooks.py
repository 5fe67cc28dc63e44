"""Build-time generators of the documentation site (``mkdocs.yml`` loads this file twice).

- As an MkDocs hook (``hooks:``), :func:`on_files` adds ``reference/cli.md``, written from
  ``microbatch.cli.build_parser()`` at every build: every command, argument and default of
  the ``microbatch`` command as the parser has them, so the page cannot go stale.
- As a Griffe extension (the Python handler's ``extensions:``), :class:`RestDocstrings`
  turns the reST of the library's docstrings into the Markdown mkdocstrings renders:
  ``:class:`~a.B``` roles into links to the reference (plain code when the target has no
  page), ``text::`` literal blocks into fenced code, simple ``====`` tables into tables.
  The docstrings stay as they are; only their rendering changes.

Nothing here is part of the library: ``make docs`` runs it, ``tests/unit/docs`` tests it.
"""

from __future__ import annotations

import argparse
import ast
import html
import re
import textwrap
from collections.abc import Iterator
from typing import Any

from griffe import Extension, NameResolutionError

#: Where the generated CLI page lands in the site.
CLI_PAGE = "reference/cli.md"

# ---- the CLI reference, from the argparse parser ------------------------------------------


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The CLI reference page of ``parser`` (default: ``microbatch.cli.build_parser()``)."""
    intro = ""
    if parser is None:
        from microbatch.cli import build_parser

        parser, intro = build_parser(), _cli_intro()
    lines = [
        "# CLI reference",
        "",
        f"Generated from `microbatch.cli.build_parser()` when the site is built: `{parser.prog}"
        " --help` and `" + parser.prog + " COMMAND --help` print the same.",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        intro,
        "",
        _arguments_table(parser),
        "",
    ]
    for name, sub, help_text in _subcommands(parser):
        lines += [
            f"## `{parser.prog} {name}`",
            "",
            _escape(help_text[:1].upper() + help_text[1:]) + ".",
            "",
            "```text",
            sub.format_usage().strip(),
            "```",
            "",
            _arguments_table(sub),
            "",
        ]
    lines += [_exit_codes(), ""]
    return "\n".join(lines)


def _cli_intro() -> str:
    """The ``microbatch.cli`` module docstring after its first line, as Markdown."""
    import microbatch.cli

    body = (microbatch.cli.__doc__ or "").split("\n", 1)[-1].strip()
    return rest_to_markdown(body, resolve=lambda name: name)


def _subcommands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, helps.get(name, "")


def _arguments_table(parser: argparse.ArgumentParser) -> str:
    rows = ["| argument | what | default |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(
            action, argparse._SubParsersAction | argparse._HelpAction
        ):
            continue
        if action.option_strings:
            value = f" {action.metavar or action.dest.upper()}" if action.nargs != 0 else ""
            name = ", ".join(f"`{o}{value}`" for o in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest}`"
        what = _escape(action.help or "")
        if action.choices:
            what += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        if action.required and action.option_strings:
            what += " **required**"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
        rows.append(f"| {name} | {what} | {shown} |")
    return "\n".join(rows)


def _exit_codes() -> str:
    from microbatch.errors import ExitCode

    rows = ["## Exit codes", "", "| code | name |", "|---|---|"]
    rows += [f"| {int(code)} | `{code.name}` |" for code in ExitCode]
    return "\n".join(rows)


def _escape(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|")


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated CLI page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, CLI_PAGE, content=cli_markdown()))
    return files


# ---- reST docstrings rendered as Markdown ---------------------------------------------------

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([\w.]+)(?:\(\))?`")
_RULE = re.compile(r"^=+(?: +=+)+ *$")


def rest_to_markdown(text: str, resolve: Any) -> str:
    """``text`` (a docstring in the library's reST) as Markdown; ``resolve`` maps a role's
    name to the identifier its link points at."""
    text = _literal_blocks(text)
    text = _tables(text)
    return _roles(text, resolve)


def _roles(text: str, resolve: Any) -> str:
    """``:class:`~a.b.C``` → an optional cross-reference to ``a.b.C`` showing ``C``: a link
    when the reference documents the target, plain code otherwise (autorefs' ``optional``
    never warns). Code blocks keep their text."""

    def link(m: re.Match[str]) -> str:
        short, name = m.group(1) == "~", m.group(2)
        shown = name.rsplit(".", 1)[-1] if short else name
        target = html.escape(resolve(name), quote=True)
        code = f"<code>{html.escape(shown)}</code>"
        return f'<autoref optional identifier="{target}">{code}</autoref>'

    parts = re.split(r"(^```.*?^```$)", text, flags=re.M | re.S)
    return "".join(p if p.startswith("```") else _ROLE.sub(link, p) for p in parts)


def _literal_blocks(text: str) -> str:
    """reST ``paragraph::`` + an indented block → ``paragraph:`` + a fenced block (Python
    when it parses as Python, else plain text)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block_end = j
        while block_end < len(lines) and (
            not lines[block_end].strip()
            or len(lines[block_end]) - len(lines[block_end].lstrip()) > indent
        ):
            block_end += 1
        while block_end > j and not lines[block_end - 1].strip():
            block_end -= 1
        if block_end == j:  # "::" not followed by an indented block: leave it
            out.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2]
        if head.strip():  # "text::" reads "text:", "text ::" reads "text"
            out.append(head.rstrip() if head.endswith(" ") else head + ":")
            out.append("")
        code = textwrap.dedent("\n".join(lines[j:block_end]))
        fence = " " * indent + "```" + ("python" if _is_python(code) else "text")
        out.append(fence)
        out += [" " * indent + c if c else "" for c in code.split("\n")]
        out.append(" " * indent + "```")
        i = block_end
    return "\n".join(out)


def _is_python(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def _tables(text: str) -> str:
    """A reST simple table (``====  ====`` rules around its header and its rows) → a
    Markdown table; a row whose first cell is empty continues the row above."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        rules = []
        if _RULE.match(lines[i].strip()):
            rules = [k for k in range(i, len(lines)) if _RULE.match(lines[k].strip())][:3]
        if len(rules) < 3:
            out.append(lines[i])
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        starts = [m.start() for m in re.finditer(r"=+", lines[i][indent:])]
        header = [_cells(r[indent:], starts) for r in lines[rules[0] + 1 : rules[1]] if r.strip()]
        body: list[list[str]] = []
        for row in lines[rules[1] + 1 : rules[2]]:
            if not row.strip():
                continue
            got = _cells(row[indent:], starts)
            if body and not got[0]:
                body[-1] = [f"{a} {b}".strip() for a, b in zip(body[-1], got, strict=True)]
            else:
                body.append(got)
        pad = " " * indent
        out.append("")
        for row in [*header[:1], ["---"] * len(starts), *body]:
            out.append(pad + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        out.append("")
        i = rules[2] + 1
    return "\n".join(out)


def _cells(row: str, starts: list[int]) -> list[str]:
    """The cells of a table row, cut at the columns' starts (the last runs to the end)."""
    ends: list[int | None] = [*starts[1:], None]
    return [row[start:end].strip() for start, end in zip(starts, ends, strict=True)]


def _documented_objects(obj: Any) -> Iterator[Any]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _documented_objects(member)


class RestDocstrings(Extension):
    """Griffe extension: every docstring of microbatch and its provider, as Markdown."""

    PACKAGES = ("microbatch", "microbatch_airflow")

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        if pkg.name not in self.PACKAGES:
            return
        for obj in _documented_objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rest_to_markdown(
                    obj.docstring.value, resolve=lambda name, obj=obj: _resolve(obj, name)
                )


def _resolve(obj: Any, name: str) -> str:
    """The full path of ``name`` as written in ``obj``'s docstring (an import or a member
    in its scope, then dotted attributes), else ``name`` itself."""
    head, _, rest = name.partition(".")
    try:
        path = obj.resolve(head)
    except NameResolutionError:
        return name
    return f"{path}.{rest}" if rest else path
