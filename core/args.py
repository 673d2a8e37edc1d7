"""Engine configuration: one dataclass, resolved against the model and the device at start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from sluice.core.errors import InvalidRequestError
from sluice.core.models.default_model import DEFAULT_MODEL

if TYPE_CHECKING:
    import torch

# torch is imported where a device or dtype is resolved, not here: the command line builds its flags from these
# fields, and `sluice --help` must not wait for torch.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


# max_model_len when not given: the model's own limit, capped here (a KV pool and a step buffer per length).
MAX_MODEL_LEN_DEFAULT = 8192

KV_ROLES = ("both", "prefill", "decode")


def _arg(default: Any, help: str, choices: tuple | None = None) -> Any:
    """An `EngineArgs` field with its help text (and choices): the one place the command line's flags read."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _quantized_on_cpu(device: torch.device, quantization: str | None) -> bool:
    """A quantized model on the CPU: its target and draft head run torch's packed kernels, the case the
    speculative defaults are tuned for (`EngineArgs.resolve_num_speculative_tokens` and
    `resolve_speculative_draft_vocab_size`)."""
    return device.type == "cpu" and quantization is not None


@dataclass(slots=True)
class EngineArgs:
    """The engine's settings; each is also a flag of `sluice serve`, `sluice generate`, ... (``max_num_seqs`` is
    ``--max-num-seqs``), with the help text given here."""

    model: str = _arg(
        DEFAULT_MODEL, "the alias smollm2-135m-instruct, a .gguf file, a Hugging Face model folder, or dummy:<shape>"
    )
    device: str = _arg("auto", "auto (a GPU when there is one), cpu, cuda or cuda:N")
    dtype: str = _arg("auto", "model dtype; auto = float32 on the CPU, bfloat16 on a GPU", ("auto", *_DTYPES))
    max_model_len: int | None = _arg(
        None, f"longest sequence, prompt + output; default: the model's own limit, at most {MAX_MODEL_LEN_DEFAULT}"
    )
    block_size: int = _arg(16, "tokens per KV block (and per prefix-cache entry)", (8, 16, 32, 64, 128))
    num_kv_blocks: int | None = _arg(None, "KV pool size in blocks; default: sized from memory")
    cpu_kv_cache_gib: float = _arg(2.0, "CPU: GiB for the KV pool when --num-kv-blocks is not given")
    gpu_memory_utilization: float = _arg(0.9, "GPU: fraction of its memory the engine may use (weights, KV pool)")
    cpu_threads: int | None = _arg(
        None,
        "CPU: torch's intra-op threads for the model; default: OMP_NUM_THREADS if set, else the cores this process "
        "may use (affinity, cgroup quota), less one for the engine's own threads from 4 cores on",
    )
    max_num_seqs: int = _arg(128, "most sequences in one step's batch")
    max_num_batched_tokens: int = _arg(2048, "most tokens in one step (longer prompts are prefilled in chunks)")
    max_waiting_requests: int = _arg(
        1024, "most sequences waiting to start; beyond it the server answers 503 (library callers wait for room)"
    )
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of prompt prefixes seen before")
    attention_backend: str = _arg("auto", "auto = triton on a GPU, torch on the CPU", ("auto", "torch", "triton"))
    enforce_eager: bool = _arg(False, "no CUDA graphs")
    cpu_compile: bool = _arg(
        False,
        "CPU: compile the decode step of up to 15 sequences with torch.compile (inductor's C++ backend) at start-up, "
        "a minute or more the first time (cached after); off: every step eager",
    )
    max_graph_tokens: int = _arg(
        2048, "GPU: steps with prefill rows of up to this many tokens replay a CUDA graph; 0 = decode steps only"
    )
    gc_freeze: bool = _arg(
        True,
        "after start-up, move every live object out of the garbage collector's reach until the engine stops "
        "(gc.freeze, as vLLM and SGLang do): full collections then skip the model, tokenizer and caches",
    )
    gil_switch_interval_ms: float = _arg(
        0.5,
        "the interpreter's GIL switch interval while the engine runs (Python's default is 5 ms): how long the "
        "executor's launch thread may wait for the GIL while the event loop's thread is busy; 0 = leave it",
    )
    fused_kernels: str = _arg(
        "auto", "Triton RMSNorm+residual, SiLU-and-mul and RoPE; auto = on for cuda", ("auto", "on", "off")
    )
    kv_cache_dtype: str = _arg(
        "auto", "auto = the model dtype; fp8 = e4m3 with static per-head scales (twice the tokens)", ("auto", "fp8")
    )
    quantization: str | None = _arg(
        None,
        "quantized linear layers: int8/int4 weight-only, fp8 W8A8 (e4m3 weights, per-token activations); auto = the "
        "CPU's fast default (int4 on a GGUF's Q4_1 blocks with bf16 activations, packed CPU kernels), none elsewhere "
        "(sluice serve's default); default: none",
        ("auto", "int8", "int4", "fp8"),
    )
    seed: int = _arg(0, "seed of the random weights (dummy models) and of requests that bring no seed of their own")
    served_model_name: str | None = _arg(None, "the model name the API reports; default: the model's own")
    speculative_model: str | None = _arg(
        None, "an EAGLE draft head folder, or 'default' for the head shipped for the default model; default: off"
    )
    num_speculative_tokens: int | None = _arg(
        None, "draft tokens proposed per step; default: 4, 3 for a quantized model on the CPU"
    )
    speculative_disable_batch_size: int = _arg(
        16, "above this many running + waiting requests a step does not speculate (it would cost throughput)"
    )
    speculative_draft_vocab_size: int | None = _arg(
        None,
        "the draft proposes only the vocabulary's first N ids, rounded up to a multiple of 64 (a BPE vocabulary's most "
        "frequent pieces: its merge order), for a head drafting over the whole vocabulary; 0 = the head's own; "
        "default: 8192 for a quantized model on the CPU, else the head's own",
    )
    tensor_parallel_size: int = _arg(
        1, "shard the model over this many worker processes (NCCL between GPUs, gloo on the CPU); 1 = in-process"
    )
    tensor_parallel_local_size: int | None = _arg(
        None, "ranks on this host (the others join from other hosts via MASTER_ADDR/MASTER_PORT); default: all"
    )
    engine_core_process: bool = _arg(
        False,
        "run the engine core (scheduler, executor, model) in a process of its own, so HTTP, detokenization and "
        "streaming never take time from scheduling; `sluice serve` turns it on. Off: one process (debugging, the "
        "smallest machines). The inspector needs one process: with it on this is ignored",
    )
    enable_inspector: bool = _arg(False, "record per-step metadata and KV snapshots for the /inspect page")
    async_scheduling: bool = _arg(
        True,
        "schedule and prepare step N+1 while the device runs step N (its sampled tokens feed N+1 on the device); "
        "off: each step waits for the last one's tokens. Speculative steps overlap only in their uniform greedy steady "
        "state (every request verifying k drafts: their next inputs stay on the device); others wait",
    )
    split_special_tokens: bool = _arg(
        False,
        "tokenize chat messages' special-token text (<|im_end|>) as plain text, so user content cannot end its "
        "turn or forge another; the template's own special tokens stay special",
    )
    # prefill/decode disaggregation (core/disagg/engine.py): the role this engine plays in a pair
    kv_role: str = _arg(
        "both",
        "both = one engine does prefill and decode; prefill / decode = one half of a disaggregated pair, which "
        "ships each prompt's KV from the prefill engine to the decode engine (sluice serve --prefill-device ... "
        "--decode-device ... starts both)",
        KV_ROLES,
    )
    kv_transfer_timeout: float = _arg(
        30.0, "prefill/decode pair: seconds a prompt's KV transfer may take before the decode engine recomputes it"
    )
    # KV events (core/ipc/kv_event_publisher.py): what the prefix cache stores and evicts, in vLLM's wire format
    kv_events_endpoint: str | None = _arg(
        None,
        "publish KV cache events (vLLM's format: ZMQ PUB, msgpack KVEventBatch) on this endpoint, e.g. "
        "tcp://*:5557 (bound) or tcp://router:5557 (connected); data-parallel rank r uses port + r; default: off",
    )
    kv_events_replay_endpoint: str | None = _arg(
        None,
        "with --kv-events-endpoint: a ROUTER socket that replays recent batches from a sequence number; default: off",
    )
    data_parallel_rank: int = _arg(0, "this engine's rank among data-parallel replicas (stamped on its KV events)")

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {msg}", param=param)

        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad("device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise bad("dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise bad("block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        cpus = os.cpu_count() or 1
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= cpus:
            raise bad("cpu_threads", f"must be in [1, {cpus}] (the machine's CPUs), got {self.cpu_threads}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise bad("kv_cache_dtype", f"must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "auto", "int8", "int4", "fp8"):
            raise bad("quantization", f"must be None, auto, int8, int4 or fp8, got {self.quantization!r}")
        if not 0 <= self.gil_switch_interval_ms <= 100:
            raise bad("gil_switch_interval_ms", f"must be in [0, 100], got {self.gil_switch_interval_ms}")
        if self.fused_kernels not in ("auto", "on", "off"):
            raise bad("fused_kernels", f"must be auto, on or off, got {self.fused_kernels!r}")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise bad("num_speculative_tokens", f"must be in [1, 16], got {self.num_speculative_tokens}")
        if self.speculative_draft_vocab_size is not None and not 0 <= self.speculative_draft_vocab_size <= 1 << 24:
            raise bad("speculative_draft_vocab_size", f"must be in [0, 2^24], got {self.speculative_draft_vocab_size}")
        if self.speculative_disable_batch_size < 1:
            raise bad("speculative_disable_batch_size", f"must be >= 1, got {self.speculative_disable_batch_size}")
        if self.speculative_model is not None and not self.speculative_model:
            raise bad("speculative_model", "must be a directory, 'default', or None")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        local, tp = self.tensor_parallel_local_size, self.tensor_parallel_size
        if local is not None and not 1 <= local <= tp:
            raise bad("tensor_parallel_local_size", f"must be in [1, tensor_parallel_size={tp}], got {local}")
        if self.tensor_parallel_size > 1 and self.speculative_model is not None:
            raise bad("speculative_model", "speculative decoding is not supported with tensor_parallel_size > 1")
        if self.kv_role not in KV_ROLES:
            raise bad("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_role != "both":
            # The transfer reads and writes the KV pool in this process, in the model's own layout.
            for name, ok in (
                ("tensor_parallel_size", self.tensor_parallel_size == 1),
                ("speculative_model", self.speculative_model is None),  # the draft head's KV is not shipped
                ("kv_cache_dtype", self.kv_cache_dtype == "auto"),  # fp8 scales are calibrated per engine
            ):
                if not ok:
                    raise bad(name, f"is not supported with kv_role={self.kv_role!r} (prefill/decode disaggregation)")
        if not self.kv_transfer_timeout > 0:
            raise bad("kv_transfer_timeout", f"must be > 0, got {self.kv_transfer_timeout}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise InvalidRequestError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidRequestError(
                "device: cuda requested but no GPU is available (use --device cpu, or auto)", param="device"
            )
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device, gguf_file: str | None = None) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            cpu_auto = self.quantization == "auto" and self.resolve_quantization(device, gguf_file) is not None
            if device.type == "cuda" or cpu_auto:  # the CPU's packed kernels take bf16 activations
                return torch.bfloat16
            return torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    def resolve_num_speculative_tokens(self, device: torch.device, quantization: str | None) -> int:
        """Draft tokens per step, the default made concrete for the device and the resolved ``quantization``: 4,
        but 3 for a quantized model on the CPU. There the verification forward runs torch's packed int4 kernels,
        which take a block of 4 rows at a time (1 + 3 tokens cost a fraction more than one, a fifth row nearly as
        much again), and the int8 LM head likewise; each draft also costs a step of the head. On the default
        model and its shipped head at batch 1, k=3 measured ahead of k=4 (docs/benchmarks/cpu_decode/)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return 3 if _quantized_on_cpu(device, quantization) else 4

    def resolve_speculative_draft_vocab_size(self, device: torch.device, quantization: str | None) -> int:
        """The draft vocabulary's size, the default made concrete (0: the head's own). On the CPU with a quantized
        model a draft step's LM head is the largest part of it (one int4 row a request of 49,152 for the default
        head, each draft token): the first 8,192 ids cut it six-fold; the verifier only needs the draft's ``q``,
        zero beyond them, so outputs do not change, only how many drafts are accepted (on the default model and
        its shipped head at batch 1 barely: docs/benchmarks/cpu_decode/). A GPU reads the whole head in
        microseconds and keeps every id its head can draft."""
        if self.speculative_draft_vocab_size is not None:
            return self.speculative_draft_vocab_size
        return 8192 if _quantized_on_cpu(device, quantization) else 0

    def resolve_quantization(self, device: torch.device, gguf_file: str | None) -> str | None:
        """The quantization the model loads with; ``auto`` made concrete. On the CPU, for a GGUF model (whose
        projections are Q4_1 blocks: the default model), ``auto`` is int4 with bf16 activations (`resolve_dtype`
        then picks bf16) where the CPU runs torch's packed int4 matmul (AVX2 / AVX-512): int4 there computes with
        the file's own weights (layers the file holds no Q4_1 blocks for stay dense: never rounded to int4 here),
        and a decode step reads a quarter of the bf16 bytes through kernels made for them
        (`core/models/cpu_linear.py`): about twice bf16's decode speed at batch 1, with perplexity within a bf16
        rounding of the fp32 model's. Elsewhere (a GPU, a model without a GGUF, a CPU without those kernels)
        ``auto`` is none: the GPU's default stays the dense model."""
        if self.quantization != "auto":
            return self.quantization
        if device.type != "cpu" or gguf_file is None:
            return None
        from sluice.core.models.cpu_linear import packed_kernels_available

        return "int4" if packed_kernels_available() else None
