"""Draft-head training: the unrolled training forward is the serving draft chain, training learns,
a resumed run equals an uninterrupted one, and the CLI's tiny smoke config trains a head that serves."""

from __future__ import annotations

import json

import pytest
import torch
from sluice.app.commands.cli import main as cli_main
from sluice.app.commands.train_draft import chat_pairs, load_conversations
from sluice.core import LLM, SamplingParams
from sluice.core.models.layers import ForwardContext
from sluice.core.models.loader import load_model, resolve_model
from sluice.kv.attention import allocate_kv_cache, get_attention_backend
from sluice.spec.eagle import load_draft_head, new_draft_head, save_draft_head
from sluice.spec.proposer import paged_metadata
from sluice.spec.train import Example, TrainConfig, target_features, train_draft_head, unrolled_forward

from tests.spec_helpers import tiny_config


@pytest.mark.parametrize("feature", ["final", "eagle3"])
def test_unrolled_steps_are_the_serving_draft_chain(feature):
    torch.manual_seed(0)
    config = tiny_config(vocab=16)
    kw = {} if feature == "final" else {"feature": "eagle3", "feature_layers": [0, 1]}
    head = new_draft_head("t", config, 64, seed=2, **kw).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    embed = torch.nn.Embedding(16, config.hidden_size)
    length, steps = 12, 3
    x = torch.randint(0, 16, (length,))
    # the target's features: its final hidden state, or (EAGLE-3) two layers' hidden states side by side
    f = torch.randn(length, config.hidden_size * (1 if feature == "final" else 2))
    nxt = torch.roll(x, -1)
    with torch.no_grad():
        train_outs = unrolled_forward(head, embed(nxt)[None], f[None], steps)
    backend = get_attention_backend("torch")
    dev = torch.device("cpu")
    for u in range(0, length - steps):
        caches = allocate_kv_cache(1, 4, 16, 1, 16, torch.float32, "cpu")
        # catch-up over the true pairs 0..u, then the chain with its own guesses and the true tokens
        pos, meta = paged_metadata([0], [u + 1], [[0]], 16, dev)
        with torch.no_grad():
            g = head(embed(nxt[: u + 1]), f[: u + 1], pos, ForwardContext(meta, caches, backend))[-1:]
            torch.testing.assert_close(g[0], train_outs[0][0, u], atol=1e-5, rtol=1e-5)
            for s in range(2, steps + 1):
                t = u + s - 1
                pos, meta = paged_metadata([t], [1], [[0]], 16, dev)
                g = head(embed(nxt[t : t + 1]), g, pos, ForwardContext(meta, caches, backend))
                torch.testing.assert_close(g[0], train_outs[s - 1][0, t], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_target():
    source = resolve_model("dummy:tiny")
    model = load_model(source, torch.float32, torch.device("cpu"), max_position=256, seed=0)
    return source, model


def _examples(n: int = 24) -> list[Example]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(5, 300, (6 + i % 5,), generator=g).tolist()
        motif = torch.randint(5, 300, (3,), generator=g).tolist()
        out.append(Example(prompt + motif * 8, len(prompt)))  # a repeated motif: learnable
    return out


CFG = dict(epochs=4, batch_tokens=256, lr=1e-2, warmup_steps=2, draft_vocab=512, checkpoint_every=3)


@pytest.mark.parametrize("feature", ["final", "eagle3"])
def test_training_learns_the_targets_next_token(tmp_path, tiny_target, feature):
    source, model = tiny_target
    cfg = TrainConfig(**{**CFG, "epochs": 30, "batch_tokens": 4096, "feature": feature})  # one batch of 4, 30 steps
    res = train_draft_head(model, "dummy:tiny", source.config, _examples(4), tmp_path, cfg, progress=False)
    first, last = res.history[0], res.history[-1]
    assert last["loss"] < first["loss"] - 0.5  # the soft cross-entropy has the target's entropy as its floor
    assert first["acc"][0] < 0.3 and last["acc"][0] > 0.6  # top-1 agreement with the target, first draft
    head = load_draft_head(tmp_path, source.config, "dummy:tiny", 128)
    assert head.cfg.feature == feature and (head.feature_fc is not None) == (feature == "eagle3")


def test_training_resumes_exactly(tmp_path, tiny_target):
    source, model = tiny_target
    cfg = TrainConfig(**CFG)
    full = train_draft_head(model, "dummy:tiny", source.config, _examples(), tmp_path / "a", cfg, progress=False)
    assert full.steps >= 8
    # interrupted half-way, then resumed from the checkpoint: the same head
    part = train_draft_head(
        model, "dummy:tiny", source.config, _examples(), tmp_path / "b", cfg, progress=False, max_steps=full.steps // 2
    )
    assert part.steps == full.steps // 2 and not (tmp_path / "b" / "model.safetensors").exists()
    resumed = train_draft_head(model, "dummy:tiny", source.config, _examples(), tmp_path / "b", cfg, progress=False)
    assert resumed.steps == full.steps
    for (name, a), b in zip(full.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    # a checkpoint of another run is refused
    with pytest.raises(ValueError, match="another run"):
        train_draft_head(model, "dummy:tiny", source.config, _examples(20), tmp_path / "b", cfg, progress=False)
    head = load_draft_head(tmp_path / "a", source.config, "dummy:tiny", 128)
    assert head.cfg.draft_vocab_size == 512 and head.cfg.training["steps"] == full.steps
    # --init-from: a new run starts from that head's weights and vocabulary
    cont = train_draft_head(
        model,
        "dummy:tiny",
        source.config,
        _examples(),
        tmp_path / "c",
        cfg,
        progress=False,
        max_steps=0,
        init_from=tmp_path / "a",
    )
    assert torch.equal(cont.head.draft_vocab, head.draft_vocab)
    for (name, a), b in zip(head.state_dict().items(), cont.head.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    # an EAGLE-1 head grows into an EAGLE-3 head that drafts exactly as it did: the high layer is the last
    with torch.no_grad():  # a final norm that is not all ones, so that the grown head must take its weight
        model.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(4))
    grown = train_draft_head(
        model,
        "dummy:tiny",
        source.config,
        _examples(),
        tmp_path / "d",
        TrainConfig(**{**CFG, "feature": "eagle3"}),
        progress=False,
        max_steps=0,
        init_from=tmp_path / "a",
    ).head
    n = source.config.num_hidden_layers
    assert grown.cfg.feature == "eagle3" and grown.cfg.feature_layers[-1] == n - 1
    assert len(grown.cfg.feature_layers) >= 2 and torch.equal(grown.draft_vocab, head.draft_vocab)
    seqs = [ex.token_ids[:40] for ex in _examples(3)]
    final = target_features(model, seqs, torch.device("cpu"), progress=False)
    layered = target_features(model, seqs, torch.device("cpu"), progress=False, aux_layers=grown.cfg.feature_layers)
    h = source.config.hidden_size
    for f1, f3, ids in zip(final, layered, seqs):
        embeds = model.model.embed_tokens(torch.tensor(ids[1:] + [0]))[None]
        with torch.no_grad():
            want = unrolled_forward(head, embeds, f1[None], 3)
            got = unrolled_forward(grown, embeds, f3[None, :, h:], 3)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(grown.feature_fc.weight, torch.zeros_like(grown.feature_fc.weight))
    # an EAGLE-3 head cannot start an EAGLE-1 run (it would lose its input)
    with pytest.raises(ValueError, match="'eagle3' features, not 'final'"):
        train_draft_head(
            model, "dummy:tiny", source.config, _examples(), tmp_path / "e", cfg, progress=False,
            init_from=save_draft_head(grown, tmp_path / "d3", dtype=torch.float32),
        )  # fmt: skip


@pytest.mark.parametrize("feature", ["final", "eagle3"])
def test_cli_smoke_trains_a_head_that_serves(tmp_path, feature):
    out = tmp_path / "head"
    assert cli_main(["train-draft", "--smoke", "--feature", feature, "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target"] == "dummy:tiny" and cfg["training"]["responses"] == "regenerate"
    assert cfg["feature"] == feature and len(cfg["feature_layers"]) == (0 if feature == "final" else 2)
    llm = LLM("dummy:tiny", device="cpu", num_kv_blocks=64, speculative_model=str(out), num_speculative_tokens=2)
    try:
        (o,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(o.outputs[0].token_ids) == 8 and llm.engine.stats().spec_num_drafts > 0
    finally:
        llm.close()


def test_training_and_evaluation_prompts_are_disjoint(default_tokenizer):
    train = load_conversations("sharegpt", "train")
    held = load_conversations("sharegpt", "heldout")
    a = {tuple(p) for p, _ in chat_pairs(default_tokenizer, train, 300, 512, 0)}
    b = {tuple(p) for p, _ in chat_pairs(default_tokenizer, held, 300, 512, 0)}
    assert len(a) > 290 and len(b) == 300 and not a & b


def test_cli_extends_cached_data_with_only_the_missing_prompts(tmp_path):
    out = tmp_path / "head"
    assert cli_main(["train-draft", "--smoke", "--out", str(out)]) == 0
    full = torch.load(out / "data.pt", weights_only=False)
    assert full["prompts_done"] == 16 and len(full["examples"]) == 16
    # Pretend an earlier run stopped (time limit) after 10 prompts, then a fake 10th sequence marks what is reused.
    marker = ([1, 2, 3, 4], 2)
    torch.save({**full, "examples": full["examples"][:9] + [marker], "prompts_done": 10}, out / "data.pt")
    assert cli_main(["train-draft", "--smoke", "--out", str(out), "--no-resume"]) == 0
    ext = torch.load(out / "data.pt", weights_only=False)
    assert ext["prompts_done"] == 16
    assert ext["examples"][:9] == full["examples"][:9] and tuple(ext["examples"][9]) == marker
    assert ext["examples"][10:] == full["examples"][10:], "the missing prompts regenerate in the same order"


def test_later_turns_follow_the_first_turns_with_their_context(default_tokenizer):
    from sluice.core.frontend.tokenizer import apply_chat_template

    convs = [["hi there", "hello!", "tell me a joke", "why did...", "another", "sure"], ["what is 2+2?", "4"]]
    first = chat_pairs(default_tokenizer, convs, 10, 512, 0)
    every = chat_pairs(default_tokenizer, convs, 10, 512, 0, later_turns=True)
    assert len(first) == 2 and every[:2] == first, "first turns stay a prefix (cached regenerations line up)"
    later = every[2:]
    assert [r for _, r in later] == ["why did...", "sure"]
    assert later[0][0] == apply_chat_template(
        default_tokenizer,
        [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"}]
        + [{"role": "user", "content": "tell me a joke"}],
    )
    # A context past the prompt limit ends the conversation's later turns; `num` caps the total.
    limit = len(later[0][0])
    assert [r for _, r in chat_pairs(default_tokenizer, convs, 10, limit, 0, later_turns=True)[2:]] == ["why did..."]
    assert len(chat_pairs(default_tokenizer, convs, 3, 512, 0, later_turns=True)) == 3


def test_cli_extra_given_examples_join_the_regenerated_ones(tmp_path):
    out = tmp_path / "head"
    assert cli_main(["train-draft", "--smoke", "--out", str(out), "--extra-given", "5"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["examples"] == 16 + 5 and cfg["training"]["extra_given"] == 5
    assert len(torch.load(out / "data.pt", weights_only=False)["examples"]) == 16, "given examples are not cached"


def test_time_limit_follows_steps_that_keep_getting_faster(tmp_path, tiny_target, monkeypatch):
    """A fake clock: the first 30 steps take 1 s, the rest 0.1 s. A plan from the average pace so far ends far
    short; re-planning from the recent pace at the planned end fills the 50 s (~30 + 200 steps)."""
    import types

    import sluice.spec.train as st

    source, model = tiny_target
    clock = {"t": 0.0, "steps": 0}
    losses = st._losses

    def timed_losses(*args, **kwargs):
        clock["steps"] += 1
        clock["t"] += 1.0 if clock["steps"] <= 30 else 0.1
        return losses(*args, **kwargs)

    monkeypatch.setattr(st, "_losses", timed_losses)
    monkeypatch.setattr(st, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    cfg = TrainConfig(**{**CFG, "epochs": 1000, "batch_tokens": 4096, "checkpoint_every": 10_000})
    examples = _examples(4)
    res = train_draft_head(model, "dummy:tiny", source.config, examples, tmp_path, cfg, progress=False, time_limit=50)
    assert 200 < res.steps < 240 and clock["t"] <= 50.5, (res.steps, clock["t"])
