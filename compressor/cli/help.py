"""`--help` that fits a terminal of 80 columns: one line per option, the options in panels.

typer's own layout gives every flag pair (`--compare/--no-compare`), short name and type a column of its own,
which leaves an 80-column terminal about 15 characters of help per line. Here each option is one row of two
columns (its names with a metavar, its one-line help), in the panel its declaration names (`rich_help_panel`,
`PANELS`); the long explanations are in docs/options.md. Parsing is typer's, unchanged: only `format_help` is
replaced, for the commands (`HelpCommand`) and the top level (`HelpGroup`).
"""

from __future__ import annotations

import inspect
import shutil

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup

#: The panels, in the order a command shows them (options without a panel go to "Options").
RUN = "The run"
SHARING = "Sharing and allocation"
MLP = "Forms of the attention and the MLP"
ATOMS = "The atoms form (--sharing atoms)"
CALIBRATION = "Calibration and evaluation"
EVALUATION = "Evaluation"
TASKS = "lm-evaluation-harness tasks"
OUTPUT = "Output and hardware"
HARDWARE = OUTPUT  # one panel: each border pair is two lines of an 80-line --help
OPTIONS = "Options"
PANELS = (RUN, SHARING, MLP, ATOMS, CALIBRATION, EVALUATION, TASKS, OUTPUT, HARDWARE)
MAX_WIDTH = 100  # wider terminals get this; the layout is made for 80
OPTIONS_DOC = "docs/options.md"


def _console() -> Console:
    width = shutil.get_terminal_size((80, 24)).columns  # COLUMNS first, as rich and click read it
    return Console(width=min(width, MAX_WIDTH), highlight=False)


def flag_names(param) -> str:
    """`--ratio, -r`; a pair `--compare/--no-compare` as `--[no-]compare`."""
    long = [o for o in param.opts if o.startswith("--")]
    short = [o for o in param.opts if not o.startswith("--")]
    negative = list(getattr(param, "secondary_opts", ()) or ())
    if negative and len(long) == 1 and negative == ["--no-" + long[0][2:]]:
        long, negative = ["--[no-]" + long[0][2:]], []
    first = "/".join([*long[:1], *negative]) if negative else (long[:1] or short[:1])[0]
    return ", ".join([first, *long[1:], *[s for s in short if s != first]])


def _label(param) -> Text:
    if isinstance(param, TyperArgument):
        return Text(param.metavar or param.name.upper(), style="bold cyan")
    label = Text(flag_names(param), style="bold cyan")
    if not getattr(param, "is_flag", False):
        label.append(" " + (param.metavar or "VALUE"), style="yellow")
    return label


def _default_text(param) -> str | None:
    default = param.default
    if isinstance(param, TyperArgument) or default is None or callable(default):
        return None
    if getattr(param, "is_flag", False):
        # a pair (--compare/--no-compare) names its default; a lone flag is off by default
        return ("yes" if default else "no") if getattr(param, "secondary_opts", None) else None
    return str(default)


def option_help(param) -> str:
    """The one-line help: the declaration's, with the default added where it does not name it."""
    text = " ".join((param.help or "").split()).removesuffix(".")
    default = _default_text(param)
    if default is not None and "default" not in text:
        text = f"{text} (default: {default})".strip()
    return text


def _panel_of(param, panels: set[str]) -> str:
    if isinstance(param, TyperArgument):
        return "Arguments"
    named = getattr(param, "rich_help_panel", None)
    if named:
        return named
    return OUTPUT if param.name == "help" and OUTPUT in panels else OPTIONS


def _panels(params: list) -> list[tuple[str, list]]:
    named = {getattr(p, "rich_help_panel", None) for p in params} - {None}
    groups: dict[str, list] = {}
    for param in params:
        if not getattr(param, "hidden", False):
            groups.setdefault(_panel_of(param, named), []).append(param)
    order = ["Arguments", OPTIONS, *PANELS]
    return sorted(groups.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def _panel(title: str, rows: list[tuple[Text, str]]) -> Panel:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for label, text in rows:
        grid.add_row(label, Text(text))
    return Panel(grid, title=title, title_align="left", border_style="dim")


def _paragraphs(text: str | None) -> list[str]:
    body = inspect.cleandoc(text or "").partition("\f")[0]
    return [" ".join(p.split()) for p in body.split("\n\n") if p.strip()]


def _description(paragraphs: list[str]) -> Padding:
    texts = [Text(p, style="" if i == 0 else "dim") for i, p in enumerate(paragraphs)]
    spaced = [part for text in texts for part in (Text(""), text)][1:]
    return Padding(Group(*spaced), (0, 1, 1, 1))


def _usage(ctx, command) -> Text:
    pieces = [ctx.command_path, "[OPTIONS]"]
    for param in command.get_params(ctx):
        if isinstance(param, TyperArgument):
            name = param.metavar or param.name.upper()
            pieces.append(name if param.required else f"[{name}]")
    return Text.assemble(("Usage: ", "bold"), " ".join(pieces))


def render_command_help(command, ctx) -> None:
    console = _console()
    console.print(Padding(_usage(ctx, command), (1, 1, 1, 1)))
    console.print(_description(_paragraphs(command.help)))
    for title, params in _panels(command.get_params(ctx)):
        console.print(_panel(title, [(_label(p), option_help(p)) for p in params]))
    console.print(Text(f" Every option explained: {OPTIONS_DOC}", style="dim"))


def render_group_help(group, ctx) -> None:
    console = _console()
    path = ctx.command_path
    usage = Text.assemble(
        ("Usage: ", "bold"), f"{path} MODEL [OPTIONS]   (the main job: compress)\n",
        "       ", f"{path} COMMAND [ARGS]...",
    )  # fmt: skip
    console.print(Padding(usage, (1, 1, 1, 1)))
    console.print(_description(_paragraphs(group.help)))
    commands = [group.get_command(ctx, name) for name in group.list_commands(ctx)]
    rows = [(Text(c.name, style="bold cyan"), _paragraphs(c.help)[0]) for c in commands if not c.hidden]
    console.print(_panel("Commands", rows))
    console.print(_panel(OPTIONS, [(_label(p), option_help(p)) for p in group.get_params(ctx)]))
    console.print(
        Text(f" A command's options: {path} COMMAND --help · explained: {OPTIONS_DOC}", style="dim")
    )


class HelpCommand(TyperCommand):
    """A typer command whose `--help` is `render_command_help`'s."""

    def format_help(self, ctx, formatter) -> None:
        render_command_help(self, ctx)


class HelpGroup(TyperGroup):
    """The top-level group, with `render_group_help`'s `--help` (its commands are registered as `HelpCommand`s),
    listing the commands in the order a newcomer needs them."""

    order = ("compress", "plan", "eval", "inspect", "show", "export", "export-dense", "recipes")

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: self.order.index(n) if n in self.order else len(self.order))

    def format_help(self, ctx, formatter) -> None:
        render_group_help(self, ctx)
