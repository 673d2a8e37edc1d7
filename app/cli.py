"""The `sluice` command: generate, serve, bench, chat, cache-sim, train-draft, ..."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields

from sluice.core.args import MAX_MODEL_LEN_DEFAULT, EngineArgs


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineArgs field as a --flag (underscores become dashes)."""
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None or isinstance(default, str):
            p.add_argument(flag, default=default, type=_optional(f.type))
        else:
            p.add_argument(flag, default=default, type=type(default))


def _optional(type_name) -> callable:
    t = str(type_name)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def cmd_generate(ns: argparse.Namespace) -> int:
    from sluice.core import LLM, SamplingParams

    # Bad input fails before the model loads.
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sampling_seed)
    messages = _read_messages(ns.messages_file) if ns.messages_file else None
    kwargs = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}
    if kwargs["num_kv_blocks"] is None:
        # One sequence: a pool for its longest possible length, not one sized for a server (2 GiB on the CPU).
        longest = kwargs["max_model_len"] or MAX_MODEL_LEN_DEFAULT
        kwargs["num_kv_blocks"] = -(-longest // kwargs["block_size"]) + 1
    with LLM(**kwargs) as llm:
        outs = llm.chat([messages], params) if messages is not None else llm.generate([ns.prompt], params)
    for o in outs:
        print(o.text)
    return 0


def _read_messages(path: str) -> list:
    from sluice.core.errors import InvalidRequestError

    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"messages_file: cannot read {path}: {e}", param="messages_file") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt or one conversation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a plain text prompt")
    src.add_argument("--messages-file", help="a JSON file with a list of chat messages")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    for register in _subcommand_modules():
        register(sub)
    return parser


def _subcommand_modules():
    """Subcommands that live beside their subject (server, benchmarks, ...) register themselves."""
    import importlib

    for name in (
        "sluice.app.server_cli",
        "sluice.app.bench.cli",
        "sluice.app.cache_sim",
        "sluice.app.inspector.cli",
        "sluice.app.train_cli",
    ):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        yield mod.register


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sluice.core.errors import SluiceError

    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns) or 0
    except SluiceError as e:  # bad input or a failed engine: its message says what, a traceback adds nothing
        print(f"sluice: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
