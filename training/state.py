"""A run's resumable state, without pickle: the trained module and AdamW's state as safetensors,
the step, settings and history as JSON (written last: it commits the checkpoint)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from training.args import TrainError

STATE_DIR = "train_state"
STATE_TENSORS = "state.safetensors"
STATE_JSON = "state.json"
FEATURES_FILE = "features.safetensors"
EVAL_FEATURES_FILE = "eval_features.safetensors"  # --eval-data's corpus, teacher forced like the training one


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save_state(state_dir: Path, net: torch.nn.Module, opt: torch.optim.Optimizer, record: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    sd = opt.state_dict()
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    for i, st in sd["state"].items():
        tensors |= {f"optim.{i}.{k}": torch.as_tensor(v).detach().cpu().contiguous() for k, v in st.items()}
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    tmp = state_dir / (STATE_TENSORS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(state_dir / STATE_TENSORS)
    atomic_write_text(state_dir / STATE_JSON, json.dumps({**record, "param_groups": groups}, indent=1) + "\n")


def load_state(state_dir: Path, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    record = json.loads((state_dir / STATE_JSON).read_text())
    tensors = load_file(str(state_dir / STATE_TENSORS))
    net.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in record["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def check_resume(out: Path, resume: bool, args: dict[str, Any], must_match: tuple[str, ...],
                 fmt: str) -> dict[str, Any] | None:
    """The saved record of the run in `out` when resuming (a run of format `fmt`, its settings equal
    to `args` on `must_match`); None for a new run, which `out` must not hold already."""
    state_dir = out / STATE_DIR
    if resume:
        if not (state_dir / STATE_JSON).is_file():
            raise TrainError(f"--resume: no training state at {state_dir / STATE_JSON}")
        saved = json.loads((state_dir / STATE_JSON).read_text())
        if saved.get("format") != fmt:
            raise TrainError(f"--resume: {state_dir / STATE_JSON} holds a run of format {saved.get('format')!r}, "
                             f"not {fmt!r} (another --kind?)")
        diffs = [f"--{k.replace('_', '-')} {args[k]!r} (the run has {saved['args'].get(k)!r})"
                 for k in must_match if saved["args"].get(k) != args[k]]
        if diffs:
            raise TrainError("--resume must keep the run's settings: " + "; ".join(diffs))
        return saved
    if (state_dir / STATE_JSON).is_file():
        step = json.loads((state_dir / STATE_JSON).read_text()).get("step")
        raise TrainError(f"{out} holds a training run already (at step {step}): --resume continues it, "
                         "or choose another --out")
    return None


def resumed_record(saved: dict[str, Any], args: dict[str, Any], command: str) -> dict[str, Any]:
    """A resumed run's record: the saved one with this session's settings and command added."""
    record = {k: v for k, v in saved.items() if k != "param_groups"}
    record["args"] = {**args, "resume": False}
    record["sessions"] = [*record.get("sessions", []), command]
    return record


def record_checkpoint(record: dict[str, Any], entry: dict[str, Any], train_s: float, state_dir: Path,
                      net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Add a checkpoint's history entry (its "step" first) to the record and save the state."""
    record["train_s"] = round(record["train_s"] + train_s, 3)
    record["history"].append(entry)
    record["step"] = entry["step"]
    record["updated"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    save_state(state_dir, net, opt, record)
