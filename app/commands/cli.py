"""The `sluice` command: generate, serve, bench, chat, cache-sim, train-draft, ..."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields

from sluice.core.args import MAX_MODEL_LEN_DEFAULT, EngineArgs
from sluice.core.errors import SluiceError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineArgs field as a --flag (underscores become dashes), with the help text, choices and default
    written beside the field (`sluice.core.args`)."""
    g = p.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default, help, choices = f.default, f.metadata["help"], f.metadata["choices"]
        if isinstance(default, bool):
            action = g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
            if "(default" not in action.help:  # Python < 3.13 appends it itself
                action.help += " (default: %(default)s)"
            continue
        kind = type(default) if default is not None else _optional(f.type)
        if default is not None:
            help += " (default: %(default)s)"
        g.add_argument(flag, default=default, type=kind, choices=choices, help=help)


def _optional(type_name) -> type:
    t = str(type_name)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def one_sequence_kv_blocks(ns: argparse.Namespace) -> int:
    """``--num-kv-blocks`` for a command that runs one sequence at a time (`generate`, `chat`): the flag's value
    if given, else a pool for the longest sequence max_model_len allows and a block of headroom, rather than one
    sized for a server (2 GiB on the CPU)."""
    if ns.num_kv_blocks is not None:
        return ns.num_kv_blocks
    longest = ns.max_model_len or MAX_MODEL_LEN_DEFAULT
    return -(-longest // ns.block_size) + 1


def cmd_generate(ns: argparse.Namespace) -> int:
    from sluice.core import LLM, SamplingParams

    # Bad input fails before the model loads.
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sampling_seed)
    messages = _read_messages(ns.messages_file) if ns.messages_file else None
    kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}
    kwargs["num_kv_blocks"] = one_sequence_kv_blocks(ns)
    with LLM(**kwargs) as llm:
        outs = llm.chat([messages], params) if messages is not None else llm.generate([ns.prompt], params)
    for o in outs[0].outputs:
        print(o.text)
    return 0


def _read_messages(path: str) -> list:
    from sluice.core.errors import InvalidRequestError

    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"messages_file: cannot read {path}: {e}", param="messages_file") from None


class DefaultsShownFormatter(argparse.HelpFormatter):
    """argparse's help, with each flag's default appended as "(default: X)" where its help does not say it already
    (a help text that explains what its None default means keeps its own words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return help
        return help + " (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """An argument parser that keeps its subcommands' action (`subcommands`), so that ``--debug`` can reach every
    subcommand's parser, and shows every flag's default. Subcommand parsers are of the same class (argparse's
    default ``parser_class``)."""

    subcommands: argparse.Action | None = None

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsShownFormatter)
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def error(self, message: str):
        """A mistake on the command line is one line, as every other user error is: not argparse's usage first
        (forty lines of flags for `serve`), which `--help` shows."""
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt or one conversation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a plain text prompt")
    src.add_argument("--messages-file", help="a JSON file with a list of chat messages")
    g.add_argument("--max-tokens", type=int, default=64, help="the most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of this request's sampling, for a repeatable sample at temperature > 0 (default: none; "
        "--seed seeds the dummy weights and unseeded sampling)",
    )
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    for register in _subcommand_modules():
        register(sub)
    return parser


def _subcommand_modules():
    """Subcommands that live beside their subject (server, benchmarks, ...) register themselves."""
    import importlib

    for name in (
        "sluice.app.commands.serve",
        "sluice.app.commands.chat",
        "sluice.app.bench.cli",
        "sluice.app.commands.cache_sim",
        "sluice.app.inspector.cli",
        "sluice.app.commands.train_draft",
    ):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        yield mod.register


# What a user can get wrong (a path, a flag's value, a file's contents) and the engine's own typed errors: these
# end the command with one line and exit status 2 (`--debug` shows the traceback); anything else is a bug and
# keeps its traceback.
USER_ERRORS = (SluiceError, ValueError, OSError)


def user_error_line(e: BaseException) -> str:
    """One line saying what is wrong (the first line of the message; a missing file named with its path)."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.strerror or e}: {e.filename}"
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _add_debug_flag(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """``--debug`` on every command (``sluice serve --debug``), not only before it."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,  # a subcommand must not reset ``sluice --debug serve``
        help="show the full traceback of an error",
    )
    subcommands = getattr(parser, "subcommands", None)
    if subcommands is not None:
        for sub in subcommands.choices.values():
            _add_debug_flag(sub, top=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    _add_debug_flag(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except USER_ERRORS as e:
        if ns.debug:
            raise
        print(f"sluice: error: {user_error_line(e)} (--debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
