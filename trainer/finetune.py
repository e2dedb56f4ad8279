"""Fine-tune a shipped policy on the fleet's own decision log.

The shipped network's warm start is a TTFT regression on exactly the features the router logs
(trainer/latency.py): its logit reads as `log(predicted TTFT) = c - logit / LOGIT_SCALE`. Here the
same regression continues on what the live fleet really did, starting from the shipped weights
(recovered from the ONNX file's initializers, or a training checkpoint):

- the newest `holdout` share of the log (by decision time) is held out; errors are reported on it
  before and after: MAE of log TTFT (each model with its own constant `c`, the median fitted on the
  training part) and `pair_order_accuracy`: for near-simultaneous decisions sent to different replicas
  (the only place the log can tell which of two replicas served faster), how often the model's
  ordering of the two replicas matches the observed ordering of their TTFTs;
- bandit feedback: the log only shows the replica that was chosen. The loss fits the chosen replica's
  logit and anchors every other replica's logit to the initial model's (`anchor` x squared
  difference, in log-TTFT units), so replicas the log says nothing about keep the prior's
  prediction instead of drifting wherever the shared weights pull them. Fresh evidence about other
  replicas comes from the decisions LOR made (fallbacks), the control arm during A/B, and the
  treatment arm's bounded exploration share (router setting `ab_explore_share`, router/serving/promotion.py).
  The card counts how many samples each replica position and each decision source contributed.

What is fitted: the 0.9 quantile of each replica's log TTFT (`quantile`, the pinball loss), so the argmax goes
to the replica whose tail is lowest. A Huber fit (`quantile=None`, `--quantile none`) fits the middle, and
then a replica with a low median and a heavy tail (few batch slots: fast alone, queueing in bursts) draws too
much traffic for the p99: on the simulated fleets of tests/bench/fleet_adapt.py the 0.9 quantile fit has the
geometric mean p99 ratio to the best heuristic 0.970 against the middle fit's 1.024 (worst 1.47 vs 2.12), and on
a real CPU fleet with such a replica 186 vs 250 and 283 vs 335 ms p99 TTFT in two pooled runs, the second inside
the noise (tests/bench/README.md). The fit's criterion (early
stopping, `follow`'s hand-over) is the pinball loss; the MAE is reported either way.

Early stopping: the newest 15 % of the training part picks the epoch kept (the initial weights
count as epoch 0), so a log too small or too noisy to learn from does not make the model worse there.

How long: `epochs` passes, raised until the fit has taken `min_steps` optimiser steps (`FinetuneConfig.epochs_for`):
a log of a couple of thousand records is three batches an epoch, and four epochs of it left the model near its
prior (tests/bench/fleet_adapt.py with such logs: geometric mean p99 ratio 1.026 at 12 steps, 0.939 at 120).

The result is exported atomically (written beside the target, checked by onnxruntime, renamed)
with a model card `NEW.json`: data span, record counts and skip reasons, errors before/after,
the feature hash.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from routewise_vllm.router.policy.features import FEATURE_SPEC_HASH, FEATURE_VERSION, N_FEATURES, model_inputs
from routewise_vllm.trainer.config import NetworkConfig
from routewise_vllm.trainer.fleet_log import FleetData, read_fleet_log
from routewise_vllm.trainer.latency import LOGIT_SCALE, MIN_TTFT_S, pinball_loss
from routewise_vllm.trainer.network import RoutingNet


class FinetuneError(ValueError):
    """Fine-tuning cannot proceed; the message names the file and what is wrong."""


@dataclass(frozen=True)
class FinetuneConfig:
    holdout: float = 0.2  # newest share of the samples kept for validation
    epochs: int = 4
    min_steps: int = 120  # more epochs where a small log gives fewer optimiser steps than this (see epochs_for)
    batch_size: int = 512
    lr: float = 1e-3
    anchor: float = 0.1  # weight of the unchosen replicas' pull towards the initial model's logits
    early_stop: float = 0.15  # newest share of the training part scored per epoch to pick the epoch kept
    pair_window_s: float = 0.5  # decisions this close in time count as "at the same moment"
    quantile: float | None = 0.9  # fit this quantile of log TTFT (pinball loss); None: its middle (Huber)
    max_records: int | None = None  # newest samples to use (None: all)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.early_stop < 1.0:
            raise FinetuneError(f"early_stop={self.early_stop}: must be within [0, 1)")
        if not 0.0 < self.holdout < 1.0:
            raise FinetuneError(f"holdout={self.holdout}: must be within (0, 1)")
        if self.quantile is not None and not 0.0 < self.quantile < 1.0:
            raise FinetuneError(f"quantile={self.quantile}: must be within (0, 1)")
        if self.epochs < 0 or self.min_steps < 0 or self.batch_size < 1 or not self.lr > 0 or self.anchor < 0:
            raise FinetuneError(f"epochs >= 0, min_steps >= 0, batch_size >= 1, lr > 0, anchor >= 0 expected, got {self}")

    def epochs_for(self, samples: int) -> int:
        """Epochs over `samples` fitted samples: `epochs`, raised until the fit takes `min_steps` optimiser steps
        (why: the module docstring, "How long"). Early stopping still keeps the best epoch; large logs (50k
        records: ~70 batches an epoch) run `epochs` as before."""
        if self.epochs == 0 or samples <= 0:
            return self.epochs
        batches = -(-samples // self.batch_size)
        return max(self.epochs, -(-self.min_steps // batches))


# ------------------------------------------------------------------ the initial model
def _network_config(path: Path, training_config: str | None) -> NetworkConfig:
    try:
        doc = json.loads(training_config or "")
        return NetworkConfig(**doc["network"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FinetuneError(
            f"{path}: metadata 'training_config' has no usable 'network' section ({type(exc).__name__}: {exc}); "
            "give the training checkpoint (.pt) instead"
        ) from None


def _onnx_state_dict(path: Path, model) -> dict[str, np.ndarray]:
    """The RoutingNet state dict from an exported graph: named initializers (biases, norms) plus the
    transposed MatMul weights the exporter renamed, identified by the named bias added to their output,
    and the normaliser's mean/std folded into the Sub/Div on the raw features."""
    from onnx import numpy_helper

    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    state = {k[4:]: v for k, v in init.items() if k.startswith("net.")}
    for node in model.graph.node:
        consts = [i for i in node.input if i in init and not i.startswith("net.")]
        if node.op_type == "MatMul" and len(consts) == 1 and init[consts[0]].ndim == 2:
            for add in consumers.get(node.output[0], []):
                biases = [i for i in add.input if i.startswith("net.") and i.endswith(".bias")] if add.op_type == "Add" else []
                if biases:
                    state[biases[0][4:-5] + ".weight"] = init[consts[0]].T
        elif node.op_type in ("Sub", "Div") and len(consts) == 1 and init[consts[0]].shape == (N_FEATURES,):
            key = "normaliser.mean" if node.op_type == "Sub" else "normaliser.std"
            state.setdefault(key, init[consts[0]])
    if "normaliser.std" not in state or "normaliser.mean" not in state:
        raise FinetuneError(f"{path}: no observation normaliser found in the graph (not a `trainer export` model?)")
    std = state.pop("normaliser.std").astype(np.float64)
    state["normaliser.var"] = np.maximum(std**2 - 1e-8, 0.0)
    state["normaliser.mean"] = state["normaliser.mean"].astype(np.float64)
    state["normaliser.count"] = np.array(1e6)
    return state


def _probe_inputs(n: int = 64, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    feats = rng.uniform(0.0, 1.0, size=(n, 6, N_FEATURES)).astype(np.float32)
    masks = (rng.uniform(size=(n, 6)) > 0.2).astype(np.float32)
    masks[:, 0] = 1.0
    return feats, masks


def load_init_model(path: str | Path) -> tuple[RoutingNet, dict]:
    """(network with the model's weights, {"policy_version", "training_config" (dict)}) from an .onnx file
    written by `trainer export` (weights recovered from its initializers and checked against onnxruntime)
    or a training checkpoint. Raises FinetuneError naming the file."""
    path = Path(path)
    if path.suffix == ".pt":
        from routewise_vllm.trainer.checkpoint import CheckpointError, load_network

        try:
            net, cfg, doc = load_network(path)
        except CheckpointError as exc:
            raise FinetuneError(str(exc)) from None
        return net, {"policy_version": f"{Path(cfg.run.run_dir).name}-{path.stem}", "training_config": cfg.model_dump(mode="json")}
    if path.suffix != ".onnx":
        raise FinetuneError(f"{path}: --init must be an .onnx model or a .pt checkpoint")
    import onnx

    from routewise_vllm.trainer.export import ExportError, check_onnx_file

    try:
        meta = check_onnx_file(path)  # loads in onnxruntime, checks the feature contract
        model = onnx.load(str(path))
    except (ExportError, OSError, ValueError) as exc:
        raise FinetuneError(f"{exc}" if str(path) in str(exc) else f"{path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - onnx raises its own DecodeError types
        raise FinetuneError(f"{path}: not a loadable ONNX model ({type(exc).__name__}: {exc})") from None
    cfg = _network_config(path, meta.get("training_config"))
    net = RoutingNet(N_FEATURES, cfg)
    state = {k: torch.from_numpy(np.array(v)) for k, v in _onnx_state_dict(path, model).items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("value_head.")]  # the value head is not exported (unused here)
    if missing or unexpected:
        raise FinetuneError(f"{path}: cannot recover the network's weights from the graph (missing {missing}, unexpected {unexpected})")
    net.eval()
    feats, masks = _probe_inputs()
    diff = _max_logit_diff(net, path, feats, masks)
    if not diff < 1e-3:
        raise FinetuneError(f"{path}: recovered weights do not reproduce the model (max |logit diff| {diff:.3g})")
    return net, {"policy_version": meta.get("policy_version", path.stem), "training_config": json.loads(meta["training_config"])}


def _max_logit_diff(net: RoutingNet, path: Path, feats: np.ndarray, masks: np.ndarray) -> float:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (ref,) = sess.run(["logits"], {"features": model_inputs(feats, masks), "mask": masks})
    with torch.no_grad():
        got = net.logits(torch.from_numpy(feats), torch.from_numpy(masks)).numpy()
    valid = masks > 0.5
    return float(np.abs(ref - got)[valid].max())


# ------------------------------------------------------------------ predictions and errors
def all_logits(net: RoutingNet, data: FleetData, batch: int = 4096) -> np.ndarray:
    out = np.empty(data.masks.shape, dtype=np.float32)
    with torch.no_grad():
        for s in range(0, len(data), batch):
            f = torch.from_numpy(data.features[s : s + batch])
            m = torch.from_numpy(data.masks[s : s + batch])
            out[s : s + batch] = net.logits(f, m).numpy()
    return out


def log_target(ttft_s: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(ttft_s, MIN_TTFT_S))


def calibrate(logits: np.ndarray, data: FleetData) -> float:
    """The constant c minimising the absolute error of c - logit/LOGIT_SCALE on `data` (the median)."""
    chosen = logits[np.arange(len(data)), data.actions]
    return float(np.median(log_target(data.ttft_s) + chosen / LOGIT_SCALE))


def prediction_errors(logits: np.ndarray, c: float, data: FleetData, pair_window_s: float) -> dict:
    """MAE of log TTFT on the chosen replicas, and the ordering accuracy on near-simultaneous pairs."""
    n = len(data)
    pred = c - logits / LOGIT_SCALE  # predicted log TTFT per replica
    y = log_target(data.ttft_s)
    a = data.actions
    mae = float(np.mean(np.abs(pred[np.arange(n), a] - y)))
    i = np.arange(n - 1)
    j = i + 1
    width = data.masks.sum(1)
    pair = (
        (data.time_s[j] - data.time_s[i] <= pair_window_s) & (a[i] != a[j]) & (width[i] == width[j])
        & (data.masks[i, a[j]] > 0.5) & (data.ttft_s[i] != data.ttft_s[j])
    )  # fmt: skip
    i, j = i[pair], j[pair]
    predicted_i_faster = pred[i, a[i]] < pred[i, a[j]]
    observed_i_faster = data.ttft_s[i] < data.ttft_s[j]
    acc = float(np.mean(predicted_i_faster == observed_i_faster)) if len(i) else None
    return {"mae_log_ttft": round(mae, 4), "pair_order_accuracy": None if acc is None else round(acc, 4), "pairs": int(len(i))}


def baseline_errors(fit: FleetData, held: FleetData, l2: float = 1.0) -> dict[str, float]:
    """MAE of log TTFT on `held` of two models fitted on `fit` without the network: a constant (the median) and a
    ridge regression on the chosen replica's feature row. The ridge is what the logged features explain without
    the network; a fine-tuned model no better than it has learned what the log can teach, and the rest of its
    error is noise the features do not see (on a shared CPU fleet: scheduling jitter)."""
    if not len(fit) or not len(held):
        raise FinetuneError("baseline_errors: an empty part")
    y_fit, y_held = log_target(fit.ttft_s), log_target(held.ttft_s)
    x_fit, x_held = (d.features[np.arange(len(d)), d.actions].astype(np.float64) for d in (fit, held))
    mu, sd = x_fit.mean(0), x_fit.std(0) + 1e-6
    a_fit, a_held = (np.c_[np.ones(len(x)), (x - mu) / sd] for x in (x_fit, x_held))
    w = np.linalg.solve(a_fit.T @ a_fit + l2 * np.eye(a_fit.shape[1]), a_fit.T @ y_fit)
    return {"constant": round(float(np.mean(np.abs(y_held - np.median(y_fit)))), 4),
            "ridge_chosen_replica": round(float(np.mean(np.abs(a_held @ w - y_held))), 4)}


# ------------------------------------------------------------------ the fit
def fit(net: RoutingNet, data: FleetData, cfg: FinetuneConfig, c0: float) -> list[dict]:
    """Continue the latency regression on `data` (in place); returns per-epoch stats.

    Early stopping: the newest `early_stop` share of `data` is not fitted but scored after every epoch
    (MAE of log TTFT, c re-fitted on the rest); the weights of the best epoch are kept, the initial
    weights included (epoch 0), so a log too small or too noisy to learn from leaves the model as it was.
    """
    if cfg.early_stop > 0 and len(data) >= 20:
        fit_part, stop_part = split(data, cfg.early_stop)
    else:
        fit_part, stop_part = data, None

    def score() -> float:  # c from the scored part itself: one constant, and no extra pass over the fitted part
        logits = all_logits(net, stop_part)
        if cfg.quantile is not None:
            return pinball_score(logits, stop_part, cfg.quantile)
        return prediction_errors(logits, calibrate(logits, stop_part), stop_part, cfg.pair_window_s)["mae_log_ttft"]

    key = "early_stop_mae_log_ttft" if cfg.quantile is None else f"early_stop_pinball_q{cfg.quantile:g}"
    best = (score(), 0, copy.deepcopy(net.state_dict())) if stop_part is not None else None
    history = _epochs(net, fit_part, cfg, c0, score if stop_part is not None else None, key)
    if best is not None:
        for k, h in enumerate(history, 1):
            if h[key] < best[0]:
                best = (h[key], k, h.pop("_state"))
            h.pop("_state", None)
        net.load_state_dict(best[2])
        history.append({"kept_epoch": best[1], key: best[0]})
    net.eval()
    return history


def _epochs(net: RoutingNet, data: FleetData, cfg: FinetuneConfig, c0: float, score, key: str) -> list[dict]:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    f = torch.from_numpy(data.features)
    m = torch.from_numpy(data.masks)
    a = torch.from_numpy(data.actions)[:, None]
    y = torch.from_numpy(log_target(data.ttft_s).astype(np.float32))
    ref = torch.from_numpy(all_logits(net, data))
    offset = nn.Parameter(torch.tensor([c0], dtype=torch.float32))
    opt = torch.optim.Adam([*net.parameters(), offset], lr=cfg.lr)
    n = len(data)
    history = []
    net.train()
    for _ in range(cfg.epochs_for(n)):
        perm = torch.randperm(n, generator=gen)
        tot = 0.0
        for s in range(0, n, cfg.batch_size):
            idx = perm[s : s + cfg.batch_size]
            logits = net.logits(f[idx], m[idx])
            pred = offset - logits.gather(1, a[idx])[:, 0] / LOGIT_SCALE
            if cfg.quantile is None:
                loss = nn.functional.huber_loss(pred, y[idx], delta=1.0)
            else:
                loss = pinball_loss(y[idx] - pred, cfg.quantile)
            if cfg.anchor > 0:
                others = m[idx].clone()
                others.scatter_(1, a[idx], 0.0)
                drift = ((logits - ref[idx]) / LOGIT_SCALE) ** 2 * others
                loss = loss + cfg.anchor * drift.sum() / others.sum().clamp(min=1.0)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            tot += loss.item() * len(idx)
        stats: dict = {"loss": round(tot / n, 5)}
        if score is not None:
            net.eval()
            stats |= {key: score(), "_state": copy.deepcopy(net.state_dict())}
            net.train()
        history.append(stats)
    net.eval()
    return history


def _residual_before_offset(logits: np.ndarray, data: FleetData) -> np.ndarray:
    """observed - predicted log TTFT on the chosen replicas, before the constant c is added to the prediction."""
    return log_target(data.ttft_s) + logits[np.arange(len(data)), data.actions] / LOGIT_SCALE


def quantile_offset(logits: np.ndarray, data: FleetData, q: float) -> float:
    """The constant c minimising the pinball loss at quantile q on `data` (the residuals' q-quantile)."""
    return float(np.quantile(_residual_before_offset(logits, data), q))


def pinball_score(logits: np.ndarray, data: FleetData, q: float, c: float | None = None) -> float:
    """Pinball loss of log TTFT on `data` at quantile q, with the constant c (default: the one best on `data`)."""
    r = _residual_before_offset(logits, data)
    r = r - (np.quantile(r, q) if c is None else c)
    return round(float(pinball_loss(torch.from_numpy(r), q)), 4)


@dataclass
class FinetuneReport:
    out: str
    card: str
    policy_version: str
    records: int
    train_samples: int
    val_samples: int
    skipped: dict
    before: dict
    after: dict
    wall_s: float
    baselines: dict  # baseline_errors on the same held-out part
    quantile: float | None = None  # FinetuneConfig.quantile: the fit's criterion is then the pinball loss

    @property
    def criterion(self) -> str:
        """The held-out error the fit minimised: a key of `before` and `after`."""
        return "mae_log_ttft" if self.quantile is None else "pinball_log_ttft"

    def summary(self) -> str:
        b, a = self.before, self.after
        acc = lambda d: "n/a" if d["pair_order_accuracy"] is None else f"{d['pair_order_accuracy']:.3f}"  # noqa: E731
        pinball = (f"held-out pinball loss of log TTFT at q={self.quantile:g} (the fit's criterion): "
                   f"{b['pinball_log_ttft']:.4f} -> {a['pinball_log_ttft']:.4f}\n") if self.quantile is not None else ""
        return (
            f"{self.records} records, {self.train_samples} train / {self.val_samples} held-out samples "
            f"(skipped {self.skipped or 'none'})\n"
            f"held-out MAE of log TTFT: {b['mae_log_ttft']:.4f} -> {a['mae_log_ttft']:.4f}; "
            f"pair order accuracy ({a['pairs']} pairs): {acc(b)} -> {acc(a)}\n{pinball}"
            f"baselines fitted on the same training part, held-out MAE: constant {self.baselines['constant']:.4f}, "
            f"ridge on the chosen replica's features {self.baselines['ridge_chosen_replica']:.4f}\n"
            f"wrote {self.out} ({self.policy_version}) and {self.card} in {self.wall_s:.1f}s"
        )


def split(data: FleetData, holdout: float) -> tuple[FleetData, FleetData]:
    n_val = max(1, int(round(len(data) * holdout)))
    if len(data) - n_val < 1:
        raise FinetuneError(f"only {len(data)} usable sample(s): need at least 2 (one to fit, one to validate)")
    idx = np.arange(len(data))
    return data.subset(idx[:-n_val]), data.subset(idx[-n_val:])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def finetune(decision_log: str | Path, init: str | Path, out: str | Path, cfg: FinetuneConfig = FinetuneConfig()) -> FinetuneReport:
    """Read the log, fit, export `out` (+ `out`.json card) atomically; raises FinetuneError / FleetLogError."""
    from routewise_vllm.trainer.export import ExportError, check_onnx_file, export_onnx

    start = time.perf_counter()
    out = Path(out)
    if out.suffix != ".onnx":
        raise FinetuneError(f"{out}: the output must be an .onnx file")
    net, meta = load_init_model(init)
    data = read_fleet_log(decision_log, cfg.max_records)
    train, val = split(data, cfg.holdout)
    ref_train = all_logits(net, train)
    c0 = calibrate(ref_train, train)
    val_before = all_logits(net, val)
    before = prediction_errors(val_before, c0, val, cfg.pair_window_s)
    offset0 = c0 if cfg.quantile is None else quantile_offset(ref_train, train, cfg.quantile)  # where the fit starts
    history = fit(net, train, cfg, offset0)
    train_after, val_after = all_logits(net, train), all_logits(net, val)
    c1 = calibrate(train_after, train)
    after = prediction_errors(val_after, c1, val, cfg.pair_window_s)
    if cfg.quantile is not None:  # the fit's own criterion on the held-out part, c from the training part
        q = cfg.quantile
        before["pinball_log_ttft"] = pinball_score(val_before, val, q, offset0)
        after["pinball_log_ttft"] = pinball_score(val_after, val, q, quantile_offset(train_after, train, q))
    baselines = baseline_errors(train, val)
    version = f"{meta['policy_version'].split('+ft')[0]}+ft{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    per_replica = np.bincount(data.actions, minlength=data.masks.shape[1]).tolist()
    finetune_doc = {
        "init": str(init), "init_policy_version": meta["policy_version"], "decision_log": str(decision_log),
        "config": asdict(cfg), "history": history, "offset_log_s": round(c1, 4),
    }
    card = {
        "policy_version": version,
        "feature_spec_hash": FEATURE_SPEC_HASH,
        "feature_version": FEATURE_VERSION,
        "finetune": {
            **finetune_doc,
            "data": {
                **data.span(), "files": data.files, "records": data.records, "samples": len(data),
                "train_samples": len(train), "validation_samples": len(val),
                "validation_from_unix_s": round(float(val.time_s[0]), 3), "skipped": data.skipped,
                "samples_per_replica_position": per_replica,
            },
            "validation_before": before,
            "validation_after": after,
            "validation_baselines": baselines,
        },
    }
    training_config = dict(meta["training_config"]) | {"finetune": finetune_doc}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}.onnx")
    try:
        export_onnx(net, tmp, version, training_config)
        check_onnx_file(tmp)
        diff = _max_logit_diff(net, tmp, *_probe_inputs())
        if not diff < 1e-3:
            raise FinetuneError(f"{tmp}: exported model disagrees with torch (max |logit diff| {diff:.3g})")
        card_path = out.with_suffix(".json")
        card["wall_s"] = round(time.perf_counter() - start, 2)
        _atomic_write_text(card_path, json.dumps(card, indent=2) + "\n")
        os.replace(tmp, out)
    except ExportError as exc:
        raise FinetuneError(str(exc)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return FinetuneReport(str(out), str(card_path), version, data.records, len(train), len(val), data.skipped,
                          before, after, card["wall_s"], baselines, cfg.quantile)
