"""The command line: `sluice generate` (a prompt or a messages file in, the generated text out, what `LLM`
gives), `sluice chat`, the engine flags' help, and user errors (one line, exit status 2)."""

from __future__ import annotations

import json

import pytest
from sluice.app.commands.cli import main
from sluice.core import LLM, SamplingParams

ENGINE = ["--model", "dummy:tiny", "--device", "cpu", "--num-kv-blocks", "32", "--max-model-len", "256"]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primes."}]


@pytest.fixture(scope="module")
def expected():
    """The same model (dummy weights are seeded) through the Python API, greedy as the CLI's default."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(model="dummy:tiny", device="cpu", num_kv_blocks=32, max_model_len=256) as llm:
        return {
            "prompt": llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text,
            "messages": llm.chat([MESSAGES], params, use_tqdm=False)[0].outputs[0].text,
        }


def test_generate_prompt(capsys, expected):
    assert main(["generate", "--prompt", PROMPT, *ENGINE, "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert expected["prompt"].strip()  # random tokens still make visible text
    assert out == expected["prompt"] + "\n"


def test_generate_messages_file(tmp_path, capsys, expected):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(MESSAGES))
    assert main(["generate", "--messages-file", str(path), *ENGINE, "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out == expected["messages"] + "\n"
    assert expected["messages"] != expected["prompt"]  # the conversation, not some default prompt, went in


def test_generate_sizes_its_pool_for_one_sequence(capsys, caplog):
    """Without --num-kv-blocks the pool holds one sequence of max_model_len (256 / 16 + 1 blocks), not the
    server-sized default (2 GiB on the CPU)."""
    engine = [a for a in ENGINE if a not in ("--num-kv-blocks", "32")]
    with caplog.at_level("INFO", logger="sluice"):
        assert main(["generate", "--prompt", PROMPT, *engine, "--max-tokens", "4"]) == 0
    assert "KV pool: 17 blocks x 16 tokens" in caplog.text
    assert capsys.readouterr().out.strip()


def test_prompt_and_messages_file_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--messages-file", str(tmp_path / "m.json"), *ENGINE])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ flags and errors


def _subparser(name: str):
    from sluice.app.commands.cli import build_parser

    return build_parser().subcommands.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_engine_flag_says_what_it_does_and_its_default(command):
    from dataclasses import fields

    from sluice.core.args import EngineArgs

    help_text = _subparser(command).format_help()
    by_flag = {a.option_strings[0]: a for a in _subparser(command)._actions if a.option_strings}
    # a server runs its engine core in a process of its own, and the CPU's fast default (quantization auto: int4 on
    # the CPU, none on a GPU); the library (and the other commands) in one process, unquantized
    own_defaults = {"engine_core_process": True, "quantization": "auto"} if command == "serve" else {}
    for f in fields(EngineArgs):
        action = by_flag["--" + f.name.replace("_", "-")]
        assert action.help and len(action.help) > 15, f.name
        assert "default" in action.help, f.name  # "(default: X)", or what None means
        assert action.default == own_defaults.get(f.name, f.default), f.name
    assert "(default: 128)" in " ".join(help_text.split())  # --max-num-seqs, as rendered


def test_help_lists_chat_and_it_exists():
    from sluice.app.commands.cli import build_parser

    assert "chat" in build_parser().format_help()
    assert "/reset" in _subparser("chat").format_help()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["generate", "--prompt", "x", "--model", "/no/such/model"], "no such file or folder: '/no/such/model'"),
        (["serve", "--model", "/no/such/model.gguf"], "model file not found: /no/such/model.gguf"),
        (["generate", "--prompt", "x", "--model", "dummy:tiny", "--device", "tpu"], "device: must be"),
        (["cache-sim", "--model", "dummy:tiny", "--trace", "/no/such/trace.jsonl"], "No such file"),
        (["cache-sim", "--model", "dummy:tiny", "--trace", "{bad}"], ":2: not JSON"),
    ],
    ids=["model-path", "serve-gguf", "device", "trace-missing", "trace-bad-line"],
)
def test_user_errors_print_one_line_and_exit_2(argv, says, capsys, tmp_path):
    if "{bad}" in argv:
        bad = tmp_path / "trace.jsonl"
        bad.write_text('{"prompt_token_ids": [1, 2, 3]}\n{oops\n')
        argv = [str(bad) if a == "{bad}" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("sluice: error: "), err
    assert says in err


def test_debug_keeps_the_traceback():
    from sluice.core.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        main(["generate", "--prompt", "x", "--model", "/no/such/model", "--debug"])


# ------------------------------------------------------------------------------------------ chat


@pytest.fixture(scope="module")
def chat_engine():
    from anyio.from_thread import start_blocking_portal
    from sluice.core import AsyncEngine, EngineArgs

    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=256)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(AsyncEngine(args)) as engine:
        yield portal, engine


def test_chat_keeps_the_history_and_reset_forgets_it(chat_engine, expected):
    """The second turn's reply is what the model gives for the whole conversation so far (what `LLM.chat`
    gives for it); after /reset a turn is answered as if it came first."""
    from sluice.app.commands.chat import ChatSession

    portal, engine = chat_engine
    params = SamplingParams(max_tokens=4, temperature=0.0)
    session = ChatSession(portal, engine, params, system="Be brief.")
    first = "".join(session.send("Name three primes."))
    assert first == expected["messages"]  # the same conversation as MESSAGES
    second = "".join(session.send("And two more?"))
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[2]["content"] == first and session.messages[4]["content"] == second
    with LLM(model="dummy:tiny", device="cpu", num_kv_blocks=32, max_model_len=256) as llm:
        again = llm.chat([session.messages[:4]], params, use_tqdm=False)[0].outputs[0].text
    assert second == again
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]
    assert "".join(session.send("Name three primes.")) == first


def test_chat_command_streams_turns_and_resets(monkeypatch, capsys, expected):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Name three primes.\n/reset\n/nope\nName three primes.\n"))
    argv = ["chat", *ENGINE, "--system", "Be brief.", "--max-tokens", "4", "--temperature", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(expected["messages"]) == 2  # the same first turn, before and after /reset
    assert "(new conversation)" in out and "unknown command /nope" in out


# ------------------------------------------------------------------------------------------ help: fast, complete


def _every_parser(parser, path=("sluice",)):
    """The parser and every subcommand's, through `CommandParser.subcommands`, with the command that reaches it."""
    yield " ".join(path), parser
    if parser.subcommands is not None:
        for name, sub in parser.subcommands.choices.items():
            yield from _every_parser(sub, (*path, name))


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["bench", "throughput", "--help"]])
def test_help_does_not_load_the_engine(argv):
    """`sluice --help` parses before it imports torch or transformers: those load inside the commands."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from sluice.app.commands.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "usage: sluice" in out
    assert out.strip().splitlines()[-1] == "[]"


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    import argparse

    from sluice.app.commands.cli import build_parser

    missing, no_default = [], []
    for command, parser in _every_parser(build_parser()):
        help_text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{command} {flag}")
                continue
            shown = parser._get_formatter()._get_help_string(action)  # the help as printed, before % expansion
            if action.default not in (None, argparse.SUPPRESS) and "default" not in shown:
                no_default.append(f"{command} {flag}")
        assert "%(default)" not in help_text, command
    assert not missing, "flags without help:\n" + "\n".join(missing)
    assert not no_default, "flags whose help does not show the default:\n" + "\n".join(no_default)


def test_the_two_seeds_say_which_is_which():
    generate = " ".join(_subparser("generate").format_help().split())
    assert "--sampling-seed" in generate and "--seed" in generate
    assert "sampling" in _flag_help("generate", "--sampling-seed") and "weights" in _flag_help("generate", "--seed")


def _flag_help(command: str, flag: str) -> str:
    return next(a.help for a in _subparser(command)._actions if flag in a.option_strings)
