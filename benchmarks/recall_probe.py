"""Probe: how fast does a Llama of the embedded model's shape learn the recall task's hop on this
machine? The first stage of the new model's curriculum (issue 23), measured before spending hours.

Each training sequence is one forwarding table (`--records` lines of `name -> name`, the task's
format) followed by `--hops` supervised lookups ("Next name:" then the name one line on from the
last one, restarting from a new start name a quarter of the time): a dense learning signal, loss
on the answers only. Every `--eval-every` steps it prints the exact-match share of held-out hops
(every token of the name right, teacher-forced), the loss and the training throughput.

    .venv/bin/python benchmarks/recall_probe.py [--records 8] [--hops 12] [--layers 8] [--minutes 15]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.tracegen.tasks.recall import ARROW, NAME_WORDS
from kvbench.tracegen.tokenizer import load_tokenizer


def example(rng: random.Random, encode, records: int, hops: int) -> tuple[list[int], list[int]]:
    """Token ids and, per token, the index of the hop it answers (-1: not supervised)."""
    names: set[str] = set()
    while len(names) < records:
        names.add(f"{rng.choice(NAME_WORDS)} {rng.choice(NAME_WORDS)}")
    pool = sorted(names)
    rng.shuffle(pool)
    target = {n: rng.choice([m for m in pool if m != n]) for n in pool}
    ids: list[int] = []
    hop_of: list[int] = []

    def add(text: str, hop: int = -1) -> None:
        tokens = encode(text)
        ids.extend(tokens)
        hop_of.extend([hop] * len(tokens))

    add("Tool output (forwarding table).")
    for name in pool:
        add(f"\n{name}{ARROW}{target[name]}")
    current = rng.choice(pool)
    add(f"\n\nStart from {current}.")
    for hop in range(hops):
        if hop and rng.random() < 0.25:
            current = rng.choice(pool)
            add(f"\n\nStart from {current}.")
        add("\n\nNext name:\n")
        current = target[current]
        add(current + "\n", hop)
    return ids, hop_of


def batch(rng: random.Random, encode, size: int, records: int, hops: int) -> tuple[torch.Tensor, torch.Tensor]:
    examples = [example(rng, encode, records, hops) for _ in range(size)]
    length = max(len(ids) for ids, _ in examples)
    tokens = torch.zeros(size, length, dtype=torch.long)
    hops_of = torch.full((size, length), -1, dtype=torch.long)
    for i, (ids, hop_of) in enumerate(examples):
        tokens[i, : len(ids)] = torch.tensor(ids)
        hops_of[i, : len(ids)] = torch.tensor(hop_of)
    return tokens, hops_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--hops", type=int, default=12)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = LlamaConfig(vocab_size=tokenizer.backend.get_vocab_size(), hidden_size=args.hidden,
                         intermediate_size=3 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=args.hidden // 8, max_position_embeddings=65536,
                         rope_theta=500000.0, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    rng, held_out = random.Random(0), random.Random(999)
    eval_tokens, eval_hops = batch(held_out, tokenizer.encode, 64, args.records, args.hops)
    print(f"records {args.records}, hops {args.hops}, {args.layers} layers x {args.hidden}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, sequences of "
          f"~{eval_tokens.shape[1]} tokens", flush=True)
    started, step, seen = time.time(), 0, 0
    while time.time() - started < args.minutes * 60:
        tokens, hops_of = batch(rng, tokenizer.encode, args.batch, args.records, args.hops)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50)
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=tokens).logits[:, :-1].float()
        supervised = hops_of[:, 1:] >= 0
        loss = torch.nn.functional.cross_entropy(logits[supervised], tokens[:, 1:][supervised])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, seen = step + 1, seen + tokens.numel()
        if step % args.eval_every == 0:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                predicted = model(input_ids=eval_tokens).logits[:, :-1].argmax(-1)
            hop = eval_hops[:, 1:]
            right = (predicted == eval_tokens[:, 1:]) | (hop < 0)
            # a hop is exact when every one of its tokens is right
            exact = [bool(right[i][hop[i] == h].all()) for i in range(len(hop)) for h in range(args.hops)]
            print(f"step {step}  {time.time() - started:.0f} s  {seen / (time.time() - started):.0f} tokens/s  "
                  f"loss {loss.item():.3f}  held-out hops exact {sum(exact) / len(exact):.1%}", flush=True)


if __name__ == "__main__":
    main()
