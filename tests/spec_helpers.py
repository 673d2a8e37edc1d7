"""Shared pieces of the speculative-decoding tests: tiny targets, draft heads, and a step loop that
drives the real scheduler and model runner without the actors."""

from __future__ import annotations

import torch
from sluice.core.args import EngineArgs
from sluice.core.models.loader import ModelSource
from sluice.core.request import Request
from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
from sluice.core.worker.model_runner import ModelRunner
from sluice.kv.attention import allocate_kv_cache
from sluice.kv.manager import KVCacheManager
from sluice.spec.eagle import eagle3_layers, new_draft_head, save_draft_head
from sluice.spec.proposer import paged_metadata
from transformers import LlamaConfig


def tiny_config(vocab: int = 8, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=vocab,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )


def random_head_dir(tmp_path, name: str, config, seed: int = 1) -> str:
    head = new_draft_head(name, config, 128, seed=seed)
    return str(save_draft_head(head, tmp_path / f"head-{seed}", dtype=torch.float32))


def copy_head_dir(tmp_path, name: str, config, feature: str = "final") -> str:
    """A head that drafts the token it was fed, again and again: often right for a random target that
    repeats itself, so verification takes its accept, reject and bonus paths. With ``feature="eagle3"``
    the target's layer features (through ``feature_fc``) nudge its guesses, so that they matter."""
    kw = {} if feature == "final" else {"feature": feature, "feature_layers": eagle3_layers(config.num_hidden_layers)}
    head = new_draft_head(name, config, 128, seed=0, **kw)
    h = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        if head.feature_fc is not None:
            # enough that passing the final hidden state for the features changes drafts, little enough
            # that the head still copies often (tests/test_spec_decode.py's uniform-step test checks both)
            head.fc.weight[:, h:] = 0.025 * torch.randn(h, h, generator=torch.Generator().manual_seed(3))
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return str(save_draft_head(head, tmp_path / f"head-copy-{feature}", dtype=torch.float32))


class StepLoop:
    """Scheduler + ModelRunner in one thread: what the actors do, minus the messaging."""

    def __init__(self, source: ModelSource, max_model_len: int, num_blocks: int, max_seqs: int, **engine_args):
        k = engine_args.get("num_speculative_tokens", 4) if engine_args.get("speculative_model") else 0
        args = EngineArgs(
            device="cpu",
            num_kv_blocks=num_blocks,
            attention_backend="torch",
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_seqs * (k + 2) + 64,
            **engine_args,
        )
        self.runner = ModelRunner(args, source, max_model_len)
        cfg = SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_seqs * (k + 2) + 64,
            max_model_len=max_model_len,
            max_waiting_requests=max_seqs,
            num_speculative_tokens=k,
            speculative_disable_batch_size=args.speculative_disable_batch_size,
        )
        self.scheduler = Scheduler(cfg, KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching))

    def run(self, requests: list[Request]) -> list[Request]:
        for r in requests:
            self.scheduler.add_request(r)
        while self.scheduler.has_work():
            so = self.scheduler.schedule()
            out = self.runner.execute(so)
            assert out.error is None, out.error
            self.scheduler.update_from_output(so, out)
        return requests


def dense_logits(model, sequences: list[list[int]], block_size: int = 16) -> torch.Tensor:
    """Logits ``[num_seqs, seq_len, vocab]`` of equal-length sequences, each computed from scratch."""
    n, length = len(sequences), len(sequences[0])
    per_seq = -(-length // block_size)
    layers = len(model.model.layers)
    caches = allocate_kv_cache(
        layers, n * per_seq, block_size, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
    )
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
    positions, meta = paged_metadata([0] * n, [length] * n, tables, block_size, torch.device("cpu"))
    from sluice.core.models.layers import ForwardContext
    from sluice.kv.attention import get_attention_backend

    ids = torch.tensor([t for s in sequences for t in s])
    with torch.inference_mode():
        hidden = model(ids, positions, ForwardContext(meta, caches, get_attention_backend("torch")))
        return model.compute_logits(hidden).float().view(n, length, -1)
