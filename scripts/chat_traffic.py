"""Chat traffic against a running `sluice serve`, through the official openai client: the stand-in for a
deployment's users in the README's "Test your prefix-cache hit rate" walk-through.

Multi-turn ShareGPT conversations (their user turns; the replies are the model's own), from two tenants: each
tenant's conversations share that tenant's system prompt and carry its ``cache_salt``, so the two never share
cache blocks. Conversations run ``--concurrency`` at a time, turn by turn, greedy (so a replay of the recorded
trace regenerates the same replies).

    python scripts/chat_traffic.py --base-url http://127.0.0.1:8000/v1 --conversations 12 --turns 4
"""

from __future__ import annotations

import argparse
import json
import random

import anyio
import openai
from sluice.app.bench.sharegpt import sharegpt_conversations

SYSTEM_PROMPTS = {
    "acme": "You are the support assistant of ACME Hardware, a chain of 40 hardware stores. Answer customers "
    "politely and briefly. You may discuss tools, paint, garden supplies, opening hours (8am to 8pm, Sundays "
    "10am to 6pm), returns (30 days with a receipt) and deliveries (free above 50 dollars). Never invent "
    "prices; ask the customer to check the store's website instead.",
    "globex": "You are Globex Travel's booking helper. Help travellers plan trips: flights, hotels, trains and "
    "visas. Keep answers short, list options as bullet points, and always remind the traveller to check entry "
    "requirements with the official embassy website before booking.",
}


async def conversation(client: openai.AsyncOpenAI, tenant: str, turns: list[str], max_tokens: int) -> int:
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[tenant]}]
    for text in turns:
        messages.append({"role": "user", "content": text})
        resp = await client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"cache_salt": tenant},
        )
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
    return len(turns)


async def main(ns: argparse.Namespace) -> None:
    convs = sharegpt_conversations(min_turns=2 * ns.turns)
    picked = random.Random(ns.seed).sample(convs, ns.conversations)
    # the user turns only, each cut to --max-chars (a chat UI's input box, and a CPU's patience)
    users = [[t[: ns.max_chars] for t in c[0 : 2 * ns.turns : 2]] for c in picked]
    tenants = [list(SYSTEM_PROMPTS)[i % len(SYSTEM_PROMPTS)] for i in range(len(users))]
    client = openai.AsyncOpenAI(base_url=ns.base_url, api_key=ns.api_key, timeout=3600)
    limit = anyio.Semaphore(ns.concurrency)
    sent = 0

    async def one(i: int) -> None:
        nonlocal sent
        async with limit:
            turns = await conversation(client, tenants[i], users[i], ns.max_tokens)
            sent += turns

    async with anyio.create_task_group() as tg:
        for i in range(len(users)):
            tg.start_soon(one, i)
    print(json.dumps({"conversations": len(users), "requests": sent, "tenants": sorted(set(tenants))}))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    p.add_argument("--max-tokens", type=int, default=48, help="reply length cap")
    p.add_argument("--max-chars", type=int, default=600, help="each user turn cut to this many characters")
    p.add_argument("--concurrency", type=int, default=4, help="conversations at a time")
    p.add_argument("--seed", type=int, default=0)
    anyio.run(main, p.parse_args())
