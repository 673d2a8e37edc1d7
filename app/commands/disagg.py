"""`sluice serve --prefill-device D1 --decode-device D2`: one server over a prefill/decode pair
(`sluice.core.disagg.engine.DisaggEngine`): prompts are computed on D1, their KV shipped to D2, which decodes.

The pair's engines share every engine flag; ``--prefill-max-num-batched-tokens`` gives the prefill engine its
own token budget (it runs nothing but prompts, so a larger one fills its device better)."""

from __future__ import annotations

import argparse
from typing import Any

from sluice.core.args import EngineArgs
from sluice.core.errors import InvalidRequestError


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument(
        "--prefill-device",
        default=None,
        help="serve a prefill/decode pair: the prefill engine's device (cpu, cuda:N); needs --decode-device",
    )
    g.add_argument("--decode-device", default=None, help="the pair's decode engine's device (cpu, cuda:N)")
    g.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=None,
        help="the prefill engine's own --max-num-batched-tokens (default: the shared one)",
    )


def pair_engine(ns: argparse.Namespace, args: EngineArgs) -> Any | None:
    """The `DisaggEngine` the flags ask for, or None (one engine). A lone prefill or decode role is refused:
    each needs its peer, which only a pair provides."""
    if ns.prefill_device is None and ns.decode_device is None:
        if args.kv_role != "both":
            raise InvalidRequestError(
                f"kv_role: a {args.kv_role} engine runs in a pair: give --prefill-device and --decode-device instead",
                param="kv_role",
            )
        return None
    if ns.prefill_device is None or ns.decode_device is None:
        raise InvalidRequestError("a prefill/decode pair needs both --prefill-device and --decode-device")
    if args.enable_inspector:
        raise InvalidRequestError("enable_inspector: not supported for a prefill/decode pair", param="enable_inspector")
    from sluice.core.disagg.engine import DisaggEngine

    for device in (ns.prefill_device, ns.decode_device):  # a device the machine lacks: one line, now
        EngineArgs(device=device).resolve_device()
    overrides = {}
    if ns.prefill_max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = ns.prefill_max_num_batched_tokens
    return DisaggEngine(args, ns.prefill_device, ns.decode_device, prefill_args=overrides)
