"""Imitation warm start (`warm_start.target: imitate`), i.e. behaviour cloning: fit the network's
logits to a heuristic's decisions (cross-entropy).

Heuristics break ties at random, so the target is soft where several replicas were equally
good to the heuristic is unknowable from one sample; plain cross-entropy on the chosen index
is still the maximum-likelihood fit of the heuristic's (stochastic) policy.
The value head is fitted to the paired discounted return as well, so PPO starts with a critic.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from routewise_vllm.trainer.network import RoutingNet, masked_categorical


def behaviour_clone(
    net: RoutingNet,
    features: np.ndarray,
    masks: np.ndarray,
    actions: np.ndarray,
    returns: np.ndarray | None,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Train `net` in place; returns per-epoch {"imitate/loss", "imitate/accuracy", "imitate/value_loss"}."""
    gen = torch.Generator().manual_seed(seed)
    f = torch.from_numpy(features.astype(np.float32))
    m = torch.from_numpy(masks.astype(np.float32))
    a = torch.from_numpy(actions.astype(np.int64))
    r = None if returns is None else torch.from_numpy(returns.astype(np.float32))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    n = len(a)
    history = []
    steps_total = epochs * ((n + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.05, 1.0 - s / max(1, steps_total)))
    net.train()
    bar = tqdm(range(epochs), desc="behaviour cloning", unit="epoch", disable=not progress)
    for _ in bar:
        perm = torch.randperm(n, generator=gen)
        tot_loss = tot_acc = tot_v = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            logits, values = net(f[idx], m[idx])
            dist = masked_categorical(logits, m[idx])
            ce = -dist.log_prob(a[idx]).mean()
            v_loss = 0.5 * ((values - r[idx]) ** 2).mean() if r is not None else torch.tensor(0.0)
            loss = ce + 0.5 * v_loss
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            k = len(idx)
            tot_loss += ce.item() * k
            tot_v += v_loss.item() * k
            tot_acc += (logits.argmax(1) == a[idx]).float().sum().item()
        stats = {"imitate/loss": tot_loss / n, "imitate/accuracy": tot_acc / n, "imitate/value_loss": tot_v / n}
        history.append(stats)
        bar.set_postfix(loss=f"{stats['imitate/loss']:.3f}", acc=f"{stats['imitate/accuracy']:.3f}")
    net.eval()
    return history
