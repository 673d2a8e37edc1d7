"""Structured outputs' request fields: `StructuredOutputsParams` validation, the wire, and the compile check that
refuses invalid or unsupported grammars."""

from __future__ import annotations

import msgspec
import pytest
from sluice.core.errors import InvalidRequestError, InvalidStructuredOutput
from sluice.core.ipc.wire import error_from_wire, error_to_wire
from sluice.core.models.loader import default_tokenizer_dir
from sluice.core.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.core.structured.registry import make_backend


@pytest.fixture(scope="module")
def backend():
    from transformers import AutoTokenizer

    return make_backend("llguidance", AutoTokenizer.from_pretrained(default_tokenizer_dir()), 49152, [2])


@pytest.mark.parametrize(
    "kwargs", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": [1]}, {"regex": ""}, {"json": 3}]
)
def test_exactly_one_valid_kind(kwargs):
    with pytest.raises(InvalidStructuredOutput) as e:
        StructuredOutputsParams(**kwargs)
    assert isinstance(e.value, InvalidRequestError) and e.value.param == "structured_outputs"


def test_min_tokens_is_refused_with_a_grammar():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
    assert e.value.param == "min_tokens"


def test_kind_and_dict_form():
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    sp = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert sp.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(regex=r"\d+", whitespace_flexible=True),
        StructuredOutputsParams(grammar='start: "x" %json {"type": "integer"}'),
        None,
    ],
)
def test_sampling_params_cross_the_wire(so):
    sp = SamplingParams(max_tokens=5, structured_outputs=so)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back == sp


def test_the_error_crosses_the_wire_as_itself():
    back = error_from_wire(error_to_wire(InvalidStructuredOutput("bad schema")))
    assert type(back) is InvalidStructuredOutput and back.param == "structured_outputs"


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputsParams(json={"type": "strng"}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(json="[1, 2]"),
        StructuredOutputsParams(regex="[a-z"),
        StructuredOutputsParams(grammar="start: undefined_rule"),
    ],
)
def test_invalid_grammars_are_refused(backend, so):
    with pytest.raises(InvalidStructuredOutput):
        backend.compile(so)


def test_valid_grammars_compile_to_the_same_source(backend):
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    a, b = backend.compile(so), backend.compile(so)
    assert a == b and a.kind == "json"
    m = backend.matcher(a)
    assert m.error is None and not m.is_terminated


def test_batched_fill_equals_one_row_at_a_time(backend):
    import numpy as np

    specs = [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(regex=r"[0-9]+x"),
        StructuredOutputsParams(choice=["left", "right"]),
    ]
    matchers = [backend.matcher(backend.compile(s)) for s in specs]
    assert matchers[1].accept_tokens(backend.tokenizer.tokenize_str("12"))
    words = (backend.vocab_size + 31) // 32
    one, batched = np.zeros((4, words), np.int32), np.zeros((4, words), np.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(one, i + 1)
    backend.fill_bitmasks([(m, i + 1) for i, m in enumerate(matchers)], batched)
    assert (one == batched).all() and one[1:].any(axis=1).all() and not one[0].any()
    assert not (one[1] == one[2]).all()


def test_a_steps_tokens_advance_the_matchers_alike_in_one_call_or_one_by_one(backend):
    """`accept_each` over a step's rows (16: past `_PARALLEL_ACCEPT_ROWS`, llguidance's parallel call) gives each
    matcher the state and result one `accept_tokens` per row gives: a token the grammar rejects is False for its
    row alone."""
    import numpy as np

    grammar = backend.compile(StructuredOutputsParams(regex=r"[0-9]{1,3}(,[0-9]{1,3})*"))
    digit, comma, letter = (backend.tokenizer.tokenize_str(c)[0] for c in ("7", ",", "x"))
    n = 16  # past the parallel call's threshold (8)
    tokens = [[digit, comma, letter][i % 3] if i else digit for i in range(n)]
    together, alone = [backend.matcher(grammar) for _ in range(n)], [backend.matcher(grammar) for _ in range(n)]
    for m in together + alone:
        assert m.accept_tokens([digit])
    got = backend.accept_each(list(zip(together, tokens)))
    want = [m.accept_tokens([t]) for m, t in zip(alone, tokens)]
    assert got == want and True in got and False in got
    words = (backend.vocab_size + 31) // 32
    for a, b, ok in zip(together, alone, got):
        if ok:  # the same position: the same next-token mask
            ma, mb = np.zeros((1, words), np.int32), np.zeros((1, words), np.int32)
            a.fill_bitmask(ma, 0)
            b.fill_bitmask(mb, 0)
            assert (ma == mb).all()
        else:
            assert a.error is not None and b.error is not None


# U+53000 is F1 93 80 80 in UTF-8 and U+0004 a control byte: SmolLM2's vocabulary holds no token with byte 0xF1
# or 0x04, so no output can spell them (schemathesis's guided_choice of odd unicode strings; llguidance forced
# the tokenizer's lossy tokenization of the bytes, and the matcher rejected the token its own mask allowed)
UNWRITABLE = [
    StructuredOutputsParams(choice=["\U00053000"]),
    StructuredOutputsParams(choice=["fine", "a\U00053000b"]),
    StructuredOutputsParams(choice=["x\x04"]),
    StructuredOutputsParams(json={"enum": ["ok", "\U00053000"]}),
    StructuredOutputsParams(json={"type": "object", "properties": {"k\U00053000": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"const": "\\ud90c\\udc00"}'),
    StructuredOutputsParams(regex="a\U00053000"),
    StructuredOutputsParams(regex=r"a\u{53000}"),
    StructuredOutputsParams(regex=r"(a|b)\x04"),
    StructuredOutputsParams(grammar='start: "a\U00053000"'),
]


@pytest.mark.parametrize("so", UNWRITABLE, ids=[str(i) for i in range(len(UNWRITABLE))])
def test_characters_the_tokenizer_cannot_write_are_refused(backend, so):
    with pytest.raises(InvalidStructuredOutput, match="cannot write the character U\\+"):
        backend.compile(so)


def test_unwritable_characters_in_annotations_compile(backend):
    schema = {
        "description": "\U00053000",
        "$defs": {"d": {"type": "integer", "title": "\x04", "$comment": "\U00053000"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d", "description": "\x04"}},
    }
    assert backend.compile(StructuredOutputsParams(json=schema)).kind == "json"
    # a class offers other characters: its escapes are not read (the grammar's own mask skips what is unwritable)
    assert backend.compile(StructuredOutputsParams(regex=r"[\x00-\x05]+\\x04")).kind == "regex"


def test_every_token_the_mask_allows_is_accepted_under_odd_unicode(backend):
    """Random walks through choices of writable odd unicode (multi-byte characters split over byte tokens, C1
    controls, the last code point): whatever the mask allows, the matcher takes, until the grammar ends."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = (backend.vocab_size + 31) // 32
    choices = ["ñ\x93", "Ó€😀", "\x80\U0010ffff", "\U00013000ñ", "\x05\x1f"]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=choices)))
    outputs = set()
    for _ in range(30):
        m, tokens = matcher.fork(), []
        while not m.is_terminated:
            mask = np.zeros((1, words), np.int32)
            m.fill_bitmask(mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: backend.vocab_size])
            assert allowed.size, m.error
            t = int(rng.choice(allowed))
            assert m.accept_tokens([t]), m.error
            tokens.append(t)
        outputs.add(backend.tokenizer.decode_bytes([t for t in tokens if t != 2]).decode())  # 2: EOS
    assert outputs <= set(choices) and len(outputs) > 1
