#!/usr/bin/python3
"""examples/train_gpt's model and recipe written again in PyTorch and trained with
DistributedDataParallel (Gloo backend), as a user who picked DDP instead of Sinew would train
it: the baseline of sinew-bench-dp-vs-ddp. Started by torchrun, one process per worker.

The same model (token and position embeddings, pre-LayerNorm blocks with causal attention
and a 4x GELU MLP, a final LayerNorm and a head that uses the token embedding's weight), the
same dimensions, AdamW (weight decay 0.1), warm-up + cosine to a tenth, clipping at 1.0,
float32, one thread per process, windows of a uint16 token file in a fresh order per epoch.
Each process runs its share of the global batch in one forward and backward.

Prints on rank 0: "ddp: trained steps 0..S-1 in T s" (from before the model's DDP wrapper is
made to after the last optimizer step, as train_gpt times its trainer).
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, e = x.shape
        hd = e // self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        split = lambda z: z.view(b, t, self.heads, hd).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e)
        h = x + self.proj(attn)
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, vocab, context, width, heads, blocks):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        nn.init.normal_(self.tok.weight, 0, 0.02)
        nn.init.normal_(self.pos.weight, 0, 0.01)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(width)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1])).unsqueeze(0)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tok.weight)  # the head tied to the embedding


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.global_batch % world:
        raise SystemExit("--global-batch must be a multiple of the processes")
    tokens = torch.from_numpy(np.fromfile(a.tokens, dtype="<u2").astype(np.int64))
    windows = (tokens.numel() - 1) // a.context
    train = windows - max(1, windows // 10)
    torch.manual_seed(1)
    t0 = time.perf_counter()
    model = nn.parallel.DistributedDataParallel(
        Gpt(a.vocab, a.context, a.width, a.heads, a.blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    share = a.global_batch // world
    order, epoch = None, -1
    for step in range(a.steps):
        lr = (a.lr * (step + 1) / a.warmup if step < a.warmup else
              a.lr / 10 + 0.5 * (a.lr - a.lr / 10) *
              (1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        first = step * a.global_batch + rank * share
        if first // train != epoch:
            epoch = first // train
            order = torch.randperm(train, generator=torch.Generator().manual_seed(epoch))
        idx = order[[(first + j) % train for j in range(share)]]
        starts = idx * a.context
        x = torch.stack([tokens[s:s + a.context] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1:s + 1 + a.context] for s in starts.tolist()])
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    if rank == 0:
        print("ddp: trained steps 0..%d in %.3f s (loss %.4f)" %
              (a.steps - 1, time.perf_counter() - t0, loss.item()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
