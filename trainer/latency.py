"""Latency warm start: the network learns to predict each routing decision's time to first token.

Behaviour cloning copies one heuristic, so it can at best tie with it. Here the network is fitted,
by regression, to what actually happened: for every decision, the time from the decision to the
request's first token on the replica it was sent to (a request sent to a replica that crashed and
re-dispatched later counts its whole wait against the first choice). Its per-replica logit is
read as a prediction,

    log(predicted TTFT on replica i) = c - logit_i / LOGIT_SCALE

with one free constant `c` (softmax and argmax ignore it), so the greedy policy sends each request
where its predicted first token comes soonest. Episodes are routed by a mix of heuristics with
epsilon-random exploration (every replica gets chosen in every kind of state), then DAgger-style
by the fitted network itself with a little exploration, fitting further on all data each round.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from routewise_vllm.router.policy.registry import make_policy
from routewise_vllm.trainer.episode import ExploreJob, LatencySamples
from routewise_vllm.trainer.network import RoutingNet

LOGIT_SCALE = 10.0  # logit difference per unit of log-TTFT difference: 10 % faster -> ~0.95 more logit
MIN_TTFT_S = 1e-3  # targets are clipped below, before the log


def explore_episode(env, job: ExploreJob, net: RoutingNet | None) -> LatencySamples:
    """Run one episode on `env` (a trainer.rollout.SpecEnv); returns features, masks, actions and
    the decision-to-first-token time of each decision (decisions of rejected or unfinished
    requests are left out)."""
    rng = np.random.default_rng([job.spec.seed, 0x1A7E])
    policy = make_policy(job.behaviour, seed=job.spec.seed) if job.behaviour is not None else None
    if policy is None and net is None:
        raise ValueError("an exploration job without a behaviour heuristic needs the network's weights")
    obs, mask, _ = env.reset_to(job.spec)
    feats, masks, acts, ids, times = [], [], [], [], []
    done = False
    while not done:
        view, request = env.decision()
        if rng.random() < job.epsilon:
            action = int(rng.choice(np.flatnonzero(mask > 0)))
        elif policy is not None:
            action = policy.choose(view, request)
        else:
            with torch.no_grad():
                logits = net.logits(torch.from_numpy(obs[None]), torch.from_numpy(mask[None]))[0].numpy()
            action = int(np.argmax(np.where(mask > 0, logits, -np.inf)))
        feats.append(obs)
        masks.append(mask)
        acts.append(action)
        ids.append(str(request.request_id))
        times.append(env.now_s)
        obs, mask, _r, done, _ = env.step(action)
    first_token = {str(r.request_id): (r.first_token_s if not r.error else np.nan) for r in env.records()}
    ttft = np.array([first_token[i] - t for i, t in zip(ids, times)], dtype=np.float64)
    keep = np.isfinite(ttft)
    return LatencySamples(
        spec=job.spec,
        features=np.stack(feats)[keep],
        masks=np.stack(masks)[keep],
        actions=np.asarray(acts, dtype=np.int64)[keep],
        ttft_s=ttft[keep],
    )


def fit_latency(
    net: RoutingNet,
    features: np.ndarray,
    masks: np.ndarray,
    actions: np.ndarray,
    ttft_s: np.ndarray,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    progress: bool = True,
    floor_s: float = 0.0,
    quantile: float | None = None,
) -> list[dict[str, float]]:
    """Fit `net`'s logits (in place) so that c - logit[action] / LOGIT_SCALE predicts log(TTFT + floor_s):
    its middle (Huber loss), or with `quantile` q its q-quantile (pinball loss), so that the argmax goes to the
    replica whose tail is lowest rather than its median. A floor of a fraction of a second spends the fit on
    the slow tail rather than on telling 50 ms from 60 ms.

    Returns per-epoch {"warm/huber" or "warm/pinball", "warm/rmse_log_ttft"}."""
    if quantile is not None and not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile={quantile}: must be within (0, 1)")
    loss_name = "warm/huber" if quantile is None else "warm/pinball"
    gen = torch.Generator().manual_seed(seed)
    f = torch.from_numpy(features.astype(np.float32))
    m = torch.from_numpy(masks.astype(np.float32))
    a = torch.from_numpy(actions.astype(np.int64))[:, None]
    y = torch.from_numpy(np.log(np.maximum(ttft_s, MIN_TTFT_S) + floor_s).astype(np.float32))
    offset = nn.Parameter(torch.tensor([float(y.mean())]))
    opt = torch.optim.Adam([*net.parameters(), offset], lr=lr)
    n = len(y)
    steps_total = epochs * ((n + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.05, 1.0 - s / max(1, steps_total)))
    net.train()
    history = []
    bar = tqdm(range(epochs), desc="latency fit", unit="epoch", disable=not progress)
    for _ in bar:
        perm = torch.randperm(n, generator=gen)
        tot_loss = tot_sq = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            logits = net.logits(f[idx], m[idx])
            pred = offset - logits.gather(1, a[idx])[:, 0] / LOGIT_SCALE
            if quantile is None:
                loss = nn.functional.huber_loss(pred, y[idx], delta=1.0)
            else:
                loss = pinball_loss(y[idx] - pred, quantile)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            tot_loss += loss.item() * len(idx)
            tot_sq += float(((pred.detach() - y[idx]) ** 2).sum())
        stats = {loss_name: tot_loss / n, "warm/rmse_log_ttft": float(np.sqrt(tot_sq / n))}
        history.append(stats)
        bar.set_postfix(rmse=f"{stats['warm/rmse_log_ttft']:.3f}")
    net.eval()
    return history


def pinball_loss(residual: torch.Tensor, q: float) -> torch.Tensor:
    """The quantile (pinball) loss of `residual` = observed - predicted: minimised by the q-quantile."""
    return torch.mean(torch.maximum(q * residual, (q - 1.0) * residual))
