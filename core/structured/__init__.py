"""Structured outputs: grammars that a request's output must match, enforced token by token.

`backend.py` is the interface (compile a `StructuredOutputsParams` into a grammar; a matcher per request that
fills its row of the next-token bitmask, accepts tokens, validates and rolls back drafts); `llguidance_backend.py`
the default implementation; `writable.py` refuses a grammar that needs a byte no token of the vocabulary holds
(what llguidance's own check lets through). `bitmask.py` applies a packed bitmask to logits in place (a Triton
kernel on the GPU, vectorised torch on the CPU). `matchers.py` holds the matchers of the requests in the
persistent batch, on the executor's side, where every accepted token passes (`core/worker/model_runner.py`
drives it).
"""
