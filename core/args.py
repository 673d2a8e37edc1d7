"""Engine configuration: one dataclass, resolved against the model and the device at start."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from sluice.core.errors import InvalidRequestError
from sluice.core.models.registry import DEFAULT_MODEL

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# max_model_len when not given: the model's own limit, capped here (a KV pool and a step buffer per length).
MAX_MODEL_LEN_DEFAULT = 8192


@dataclass(slots=True)
class EngineArgs:
    model: str = DEFAULT_MODEL
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" = float32 on the CPU, bfloat16 on the GPU
    max_model_len: int | None = None  # None = the model's own limit, capped at MAX_MODEL_LEN_DEFAULT
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = sized from memory
    cpu_kv_cache_gib: float = 2.0  # CPU: memory for the KV pool when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int = 1024
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    fused_kernels: str = "auto"  # "auto" (on for cuda) | "on" | "off": Triton RMSNorm+residual, SiLU-and-mul, RoPE
    # "auto" = the model dtype; "fp8" = e4m3 with static per-head scales (kv/attention/fp8.py): twice the tokens
    kv_cache_dtype: str = "auto"
    # None = the model dtype; "int8" | "int4" = weight-only quantized linear layers (core/models/quant.py)
    quantization: str | None = None
    seed: int = 0
    served_model_name: str | None = None
    # Speculative decoding: an EAGLE draft head (a directory, or "default" for the head shipped for the
    # default model); None = off.
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    # Above this many running + waiting requests a step does not speculate (it would cost throughput).
    speculative_disable_batch_size: int = 16
    # Tensor parallelism: one worker process per rank (torch.distributed: NCCL on GPUs, gloo on the CPU);
    # 1 = the model runs in the engine's own process. Ranks 0..local_size-1 run on this host; the others
    # join from other hosts through MASTER_ADDR / MASTER_PORT (`core/tp_worker.py`). None = all here.
    tensor_parallel_size: int = 1
    tensor_parallel_local_size: int | None = None
    # Record per-step metadata and KV snapshots for the /inspect page (`core.inspector`); off costs nothing.
    enable_inspector: bool = False
    # Chat messages' content is tokenized as plain text: special-token text a user writes ("<|im_end|>") stays
    # text and cannot end its turn or forge another one; the template's own special tokens stay special.
    split_special_tokens: bool = False

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
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise bad("kv_cache_dtype", f"must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise bad("quantization", f"must be None, int8 or int4, got {self.quantization!r}")
        if self.fused_kernels not in ("auto", "on", "off"):
            raise bad("fused_kernels", f"must be auto, on or off, got {self.fused_kernels!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise bad("num_speculative_tokens", f"must be in [1, 16], got {self.num_speculative_tokens}")
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
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidRequestError("device: cuda requested but no GPU is available", param="device")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
