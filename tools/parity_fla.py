"""Training parity with flash-linear-attention: our model and fla-core's GatedDeltaNetForCausalLM
trained from the same weights on the same tokens, step for step (issue 25).

    python3 tools/parity_fla.py prepare --config configs/gdn-0.4b.yaml --dir $W       # init + export
    python3 tools/parity_fla.py train --dir $W --side ours --steps 500 --warmup 20 --out ours.json
    python3 tools/parity_fla.py train --dir $W --side fla  --steps 500 --warmup 20 --out fla.json \
        --check-gradients grads.json --also 30:8:fla_w8.json   # first the gradient check, then runs
    python3 tools/parity_fla.py compare ours.json fla.json --out parity.json --png parity.png
    python3 tools/parity_fla.py spikes run1.json run2.json ...       # the early-spike summary

The spike study starts runs from other initialisations: `prepare --init fla` replaces every exported
tensor by fla-core's own initialisation of the same model (GatedDeltaNetForCausalLM(config) under
train.seed), `--take-from-fla REGEX` only the tensors whose exported name matches (e.g.
'conv1d.weight$'); `train --set train.FIELD=VALUE` changes one training setting of a run.

`prepare` initialises the config's model once, as the trainer does (model.build.build_model with
train.seed), writes it as a step-0 checkpoint and exports it with `gdn-convert to-hf` (fp32). Both
sides load that folder: ours through `model_from_hf`, fla's through `from_pretrained`; `train`
checks every loaded tensor equals the export. The sides share everything but the model: the token
stream (data.source through TokenBatches, documents packed with cu_seqlens, which both models take),
micro-batching (train.microbatch_size rows a forward), the loss (summed cross-entropy of the step's
labelled tokens over their count), AdamW with the trainer's parameter groups (no decay on 1-D
parameters, A_log and dt_bias: both models mark them), the warmup-cosine schedule, clipping to
train.grad_clip, bf16 autocast over fp32 weights. Each side is one process (one GPU each when there
are two: run them at once).

fla-core raises in its gated backward on Hopper under Triton < 3.7.1 (its issue #640: some Triton
versions miscompile chunk_bwd_dqkwg). `train --side fla` lifts that guard only on such
a machine, and `--check-gradients` measures what it costs: every parameter gradient of fla's bf16 step and of
ours against our fp32 model (PyTorch chunk algorithm) from the same weights and tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn_parallel.config import IGNORE_INDEX, Config  # noqa: E402
from gdn_parallel.data import TokenBatches  # noqa: E402
from gdn_parallel.model import NO_WEIGHT_DECAY  # noqa: E402
from gdn_parallel.train.__main__ import resolve_config_path  # noqa: E402
from gdn_parallel.train.optim import build_optimizer  # noqa: E402
from gdn_parallel.train.schedule import schedule_from_config  # noqa: E402

CONFIG_COPY, INIT, HF, INIT_SOURCE = "config.yaml", "init", "hf", "init_source.json"


# --------------------------------------------------------------------------------------------------
# prepare: one initialisation, exported as users export

def prepare(args) -> None:
    from gdn_parallel.convert import to_hf
    from gdn_parallel.convert.commands import data_stream_start
    from gdn_parallel.convert.dcp_io import write_checkpoint
    from gdn_parallel.model.build import build_model
    config = Config.from_yaml(resolve_config_path(args.config), args.set)
    if set(config.model.layer_types) != {"G"}:
        raise SystemExit(f"{args.config}: fla's GatedDeltaNetForCausalLM holds GDN layers only; give a pure "
                         "GDN config")
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / CONFIG_COPY).write_text(config.to_yaml(), encoding="utf-8")
    model = build_model(config.model, "cpu", config.train.seed)
    tensors = {name: t.detach() for name, t in model.state_dict().items()}
    if config.model.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    write_checkpoint(work / INIT, tensors, config, data_stream_start(config))
    to_hf(work / INIT, work / HF)
    pattern = "." if args.init == "fla" else args.take_from_fla
    taken = take_fla_init(work / HF, config.train.seed, pattern) if pattern else []
    source = {"init": args.init, "take_from_fla": pattern, "tensors_from_fla": len(taken),
              "examples": taken[:6]}
    (work / INIT_SOURCE).write_text(json.dumps(source, indent=1))
    if taken:
        print(f"{len(taken)} exported tensors replaced by fla-core's own init (pattern {pattern!r}), "
              f"e.g. {taken[:3]}")
    digest = hashlib.sha256()
    for file in sorted((work / HF).glob("*.safetensors")):
        digest.update(file.read_bytes())
    print(f"prepared {work}: {sum(t.numel() for t in tensors.values()):,} parameters, exported to "
          f"{work / HF} (sha256 of its weights {digest.hexdigest()[:16]})")


def take_fla_init(folder: Path, seed: int, pattern: str) -> list[str]:
    """Rewrite the exported tensors whose name matches `pattern` with fla-core's own initialisation of
    the same model (its post_init under `seed`); returns the names replaced. The rest of the step-0
    checkpoint stays ours: `train` reads only this folder."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from gdn_parallel.convert.safetensors_io import folder_files, read_file, write_file
    torch.manual_seed(seed)
    fla_state = GatedDeltaNetForCausalLM(GatedDeltaNetConfig.from_pretrained(folder)).state_dict()
    regex, taken = re.compile(pattern), []
    for shard, names in folder_files(folder).items():
        tensors = read_file(folder / shard)
        chosen = [n for n in names if regex.search(n)]
        for name in chosen:
            if fla_state[name].shape != tensors[name].shape:
                raise SystemExit(f"{name}: fla-core's init has shape {tuple(fla_state[name].shape)}, "
                                 f"the export {tuple(tensors[name].shape)}")
            tensors[name] = fla_state[name].to(tensors[name].dtype)
        if chosen:
            write_file(folder / shard, tensors)
        taken += chosen
    if not taken:
        raise SystemExit(f"--take-from-fla {pattern!r} matches no exported tensor name")
    return taken


def load_config(work: Path, steps: int, warmup: int, lr=None, overrides=()) -> Config:
    config = Config.from_yaml(work / CONFIG_COPY, list(overrides))
    train = config.train
    train.steps, train.warmup_steps = steps, warmup
    if lr is not None:
        train.lr = lr
    return config.validate()


# --------------------------------------------------------------------------------------------------
# The two sides: a module and its summed cross-entropy of a packed micro-batch

def lift_fla_guard() -> bool:
    """Lift fla's Hopper + Triton < 3.7.1 refusal of its gated backward; True when it was in force."""
    from fla import utils
    from fla.ops.common import chunk_o
    affected = utils.IS_NVIDIA_HOPPER and utils.TRITON_ABOVE_3_4_0 and not utils.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return bool(affected)


def load_side(side: str, work: Path, device) -> tuple[torch.nn.Module, Callable]:
    if side == "ours":
        from gdn_parallel.convert import model_from_hf
        model = model_from_hf(work / HF, device=device)

        def loss_sum(row):
            return model(row.input_ids, labels=row.labels, cu_seqlens=row.cu_seqlens,
                         position_ids=row.position_ids).loss_sum
        return model, loss_sum
    from fla.models import GatedDeltaNetForCausalLM
    model = GatedDeltaNetForCausalLM.from_pretrained(work / HF, torch_dtype=torch.float32).to(device)
    for module in model.modules():  # the flags param_groups reads (set by fla's init, kept here explicitly)
        for name in ("A_log", "dt_bias"):
            if isinstance(getattr(module, name, None), torch.nn.Parameter):
                setattr(getattr(module, name), NO_WEIGHT_DECAY, True)

    def loss_sum(row):
        # fla-core's kernels read the boundaries on the device (PackedBatch.to keeps them on the host)
        cu_seqlens = row.cu_seqlens.to(row.input_ids.device)
        hidden = model.model(input_ids=row.input_ids, cu_seqlens=cu_seqlens, use_cache=False)[0]
        logits = model.lm_head(hidden)
        return F.cross_entropy(logits.float().flatten(0, 1), row.labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return model, loss_sum


def export_mismatches(side: str, model: torch.nn.Module, work: Path) -> list[str]:
    """Tensors of the loaded model that differ from the exported folder (names as exported)."""
    from gdn_parallel.convert.hf_format import hf_name
    from gdn_parallel.convert.safetensors_io import read_folder
    exported = read_folder(work / HF)
    state = model.state_dict()
    wrong = []
    for name, tensor in state.items():
        key = name if side == "fla" else hf_name(name)
        if key in exported and not torch.equal(tensor.detach().cpu(), exported[key]):
            wrong.append(key)
    missing = [key for key in exported if key not in {n if side == "fla" else hf_name(n) for n in state}]
    return wrong + [f"{key} (not loaded)" for key in missing]


def group_summary(optimizer) -> list[dict]:
    return [{"weight_decay": g["weight_decay"], "tensors": len(g["params"]),
             "elements": sum(p.numel() for p in g["params"])} for g in optimizer.param_groups]


# --------------------------------------------------------------------------------------------------
# train: one side, every step recorded

def train_side(args) -> None:
    """Each run given (--steps/--warmup/--out, then every --also) in this one process: fla-core's
    kernels autotune once."""
    if args.check_gradients:
        gradients(args.dir, args.gradient_tokens, args.check_gradients)
    runs = [(args.steps, args.warmup, args.out)]
    for spec in args.also:
        steps, warmup, out = spec.split(":", 2)
        runs.append((int(steps), int(warmup), out))
    for steps, warmup, out in runs:
        train_run(Path(args.dir), args.side, steps, warmup, args.lr, Path(out), args.set)


def train_run(work: Path, side: str, steps: int, warmup: int, lr, out: Path, overrides=()) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a check of the tool itself
    config = load_config(work, steps, warmup, lr, overrides)
    train = config.train
    guard_lifted = lift_fla_guard() if side == "fla" else False
    torch.manual_seed(train.seed)
    model, loss_sum = load_side(side, work, device)
    mismatches = export_mismatches(side, model, work)
    if mismatches:
        raise SystemExit(f"{side}: loaded weights differ from the export: {mismatches[:5]}")
    model.train()
    optimizer = build_optimizer(model.parameters(), train, device)
    schedule = schedule_from_config(train)
    batches = TokenBatches.from_config(config.data, train.seq_len, train.microbatch_rows)
    accumulate = train.batch_size // train.microbatch_rows
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    record = {"side": side, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "fla": _fla_version(), "config": str(work / CONFIG_COPY),
              "steps": train.steps, "warmup_steps": train.warmup_steps, "lr": train.lr,
              "batch": f"{train.batch_size} x {train.seq_len} in micro-batches of {train.microbatch_rows}",
              "fla_guard_lifted": guard_lifted, "param_groups": group_summary(optimizer),
              "init": _init_source(work), "overrides": list(overrides),
              "loss": [], "grad_norm": [], "lr_at": [], "step_s": []}
    for step in range(train.steps):
        start = time.perf_counter()
        rows = [next(batches).to(device) for _ in range(accumulate)]
        count = sum(int((row.labels != IGNORE_INDEX).sum()) for row in rows)
        lr_now = schedule(step)
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        total = torch.zeros((), device=device)
        for row in rows:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = loss_sum(row) / count
            loss.backward()
            total += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["loss"].append(float(total))
        record["grad_norm"].append(float(grad_norm))
        record["lr_at"].append(lr_now)
        record["step_s"].append(time.perf_counter() - start)
        if step % 10 == 0 or step == train.steps - 1:
            print(f"{side} step {step} | loss {record['loss'][-1]:.4f} | grad_norm "
                  f"{record['grad_norm'][-1]:.3f} | lr {lr_now:.2e} | {record['step_s'][-1]:.2f} s",
                  flush=True)
            out.write_text(json.dumps(record))  # a run stopped part-way keeps what it did
    record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out.write_text(json.dumps(record))
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()


def _init_source(work: Path) -> dict:
    path = work / INIT_SOURCE
    return json.loads(path.read_text()) if path.is_file() else {"init": "ours"}


def _fla_version() -> str:
    try:
        from importlib.metadata import version
        return version("fla-core")
    except Exception:  # noqa: BLE001 - not installed: the record says so
        return "not installed"


# --------------------------------------------------------------------------------------------------
# gradients: fla's bf16 backward (guard lifted) and ours against our fp32 model

def gradients(work_dir: str, tokens: int, out: str) -> None:
    from gdn_parallel.convert.hf_format import hf_name
    work, device = Path(work_dir), torch.device("cuda")
    config = Config.from_yaml(work / CONFIG_COPY, [])
    guard_lifted = lift_fla_guard()
    row = next(TokenBatches.from_config(config.data, tokens, 1)).to(device)
    count = int((row.labels != IGNORE_INDEX).sum())

    def grads_of(side: str, autocast: bool, impl: str = "auto") -> dict[str, torch.Tensor]:
        model, loss_sum = load_side(side, work, device)
        if side == "ours":
            for module in model.modules():
                if hasattr(module, "impl"):  # the GDN layers: PyTorch's chunk algorithm for the reference
                    module.impl = impl
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_sum(row) / count
        loss.backward()
        grads = {(name if side == "fla" else hf_name(name)): p.grad.detach().double().cpu()
                 for name, p in model.named_parameters() if p.grad is not None}
        del model
        torch.cuda.empty_cache()
        return grads, float(loss)

    reference, reference_loss = grads_of("ours", False, impl="chunk")
    ours, ours_loss = grads_of("ours", True)
    fla, fla_loss = grads_of("fla", True)

    def errors(grads):
        return {name: float((grads[name] - ref).norm() / ref.norm().clamp_min(1e-30))
                for name, ref in reference.items() if name in grads and ref.norm() > 0}
    ours_err, fla_err = errors(ours), errors(fla)
    kinds = sorted({name.split(".")[-2] + "." + name.split(".")[-1] if "layers" in name else name
                    for name in ours_err})
    by_kind = {}
    for kind in kinds:
        names = [n for n in ours_err if n.endswith(kind) or n == kind]
        by_kind[kind] = {"ours_max": max(ours_err[n] for n in names),
                         "fla_max": max(fla_err.get(n, math.inf) for n in names)}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fla": _fla_version(),
              "tokens": tokens, "fla_guard_lifted": guard_lifted,
              "loss": {"fp32": reference_loss, "ours_bf16": ours_loss, "fla_bf16": fla_loss},
              "missing_in_fla": sorted(set(reference) - set(fla)), "by_kind": by_kind,
              "ours_max": max(ours_err.values()), "fla_max": max(fla_err.values())}
    for kind, row_ in by_kind.items():
        print(f"{kind:<40} ours {row_['ours_max']:.2e}  fla {row_['fla_max']:.2e}")
    print(f"loss fp32 {reference_loss:.5f} ours bf16 {ours_loss:.5f} fla bf16 {fla_loss:.5f}; "
          f"max rel err ours {result['ours_max']:.2e} fla {result['fla_max']:.2e}")
    Path(out).write_text(json.dumps(result, indent=1))


# --------------------------------------------------------------------------------------------------
# compare: the criteria and the picture

def compare(args) -> int:
    ours, fla = (json.loads(Path(p).read_text()) for p in (args.ours, args.fla))
    n = min(len(ours["loss"]), len(fla["loss"]))
    diff = [a - b for a, b in zip(ours["loss"][:n], fla["loss"][:n])]
    last = min(args.last, n)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    after = [abs(d) for d in diff[args.settle:]] or [0.0]
    result = {"steps_compared": n, "last": last,
              "mean_last_ours": mean(ours["loss"][n - last:n]),
              "mean_last_fla": mean(fla["loss"][n - last:n]),
              "max_abs_diff_after_settle": max(after), "settle": args.settle,
              "step_of_max_diff": args.settle + after.index(max(after)),
              "ours_step_s": mean(ours["step_s"][5:n]) if n > 5 else None,
              "fla_step_s": mean(fla["step_s"][5:n]) if n > 5 else None,
              "param_groups": {"ours": ours["param_groups"], "fla": fla["param_groups"]},
              "device": ours["device"], "fla_guard_lifted": fla["fla_guard_lifted"]}
    result["mean_last_diff"] = result["mean_last_ours"] - result["mean_last_fla"]
    ok = (abs(result["mean_last_diff"]) <= args.mean_tol
          and result["max_abs_diff_after_settle"] <= args.step_tol)
    result["within_criteria"] = ok
    print(json.dumps({k: v for k, v in result.items() if k != "param_groups"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.png:
        plot(ours, fla, n, args.png, args.title or Path(ours["config"]).parent.name)
    return 0 if ok else 1


def spikes(args) -> int:
    """Per run: the largest rise of the loss over the step before (a spike), the steps that rose by more
    than --rise, the largest pre-clip gradient norm after step 5, the mean loss of the last steps, and
    how the run's step-to-step loss changes from --from-step on correlate with the first run's: runs
    that share only the data (other lr, init or model) rise and fall together where the batches do."""
    records = [json.loads(Path(path).read_text()) for path in args.runs]
    changes = [_changes(r["loss"], args.from_step) for r in records]
    rows = []
    for path, record, change in zip(args.runs, records, changes):
        loss, norms = record["loss"], record["grad_norm"]
        rises = list(zip(_changes(loss, 1), range(1, len(loss))))
        biggest, at = max(rises) if rises else (0.0, 0)
        last = loss[-args.last:]
        rows.append({"run": Path(path).stem, "side": record["side"], "steps": len(loss),
                     "warmup": record["warmup_steps"], "lr": record["lr"],
                     "init": record.get("init", {"init": "ours"}), "overrides": record.get("overrides", []),
                     "largest_rise": biggest, "at_step": at,
                     "steps_rising_more": [t for r, t in rises if r > args.rise],
                     "max_grad_norm_after_5": max(norms[5:], default=0.0), "mean_last": sum(last) / len(last),
                     "corr_changes_with_first": _correlation(changes[0], change)})
    print(f"{'run':<28} {'side':<5} {'lr':>7} {'warmup':>6} {'largest rise':>13} "
          f"{'rises>' + str(args.rise):>9} {'max gnorm':>9} {'mean last ' + str(args.last):>13} {'corr':>5}")
    for row in rows:
        corr = row["corr_changes_with_first"]
        print(f"{row['run']:<28} {row['side']:<5} {row['lr']:>7.1e} {row['warmup']:>6} "
              f"{row['largest_rise']:>8.2f} @{row['at_step']:<3} {len(row['steps_rising_more']):>9} "
              f"{row['max_grad_norm_after_5']:>9.1f} "
              f"{row['mean_last']:>13.3f} {'' if corr is None else f'{corr:5.2f}'}")
    if args.out:
        summary = {"rise": args.rise, "last": args.last, "from_step": args.from_step, "runs": rows}
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.png:
        plot_runs(records, [row["run"] for row in rows], args.png, args.title or "loss per step")
    return 0


def _changes(loss: list[float], start: int) -> list[float]:
    return [loss[t] - loss[t - 1] for t in range(max(start, 1), len(loss))]


def _correlation(a: list[float], b: list[float]) -> float | None:
    """Pearson's r over the steps both runs have; None for fewer than 3 or a constant series."""
    n = min(len(a), len(b))
    if n < 3:
        return None
    try:
        return statistics.correlation(a[:n], b[:n])
    except statistics.StatisticsError:
        return None


def plot_runs(records: list[dict], names: list[str], png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for record, name in zip(records, names):
        top.plot(record["loss"], label=name, linewidth=1)
        bottom.plot(record["grad_norm"], label=name, linewidth=1)
    top.set_ylabel("training loss (nats)")
    bottom.set_ylabel("grad norm (before clipping)")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    top.set_title(title)
    top.legend(fontsize=7)
    fig.tight_layout()
    partial = Path(png).with_suffix(".partial.png")
    fig.savefig(partial, dpi=110)
    partial.replace(png)
    plt.close(fig)


def plot(ours: dict, fla: dict, n: int, png: str, title: str) -> None:
    first = [{"loss": r["loss"][:n], "grad_norm": r["grad_norm"][:n]} for r in (ours, fla)]
    plot_runs(first, ["gdn-parallel", "fla-core"], png, title)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--config", required=True)
    s.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    s.add_argument("--dir", required=True)
    s.add_argument("--init", choices=("ours", "fla"), default="ours",
                   help="whose initialisation the exported weights are (default: ours, build_model's)")
    s.add_argument("--take-from-fla", default=None, metavar="REGEX",
                   help="with --init ours: exported tensors whose name matches REGEX from fla-core's init")
    s = sub.add_parser("train")
    s.add_argument("--dir", required=True)
    s.add_argument("--side", choices=("ours", "fla"), required=True)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--warmup", type=int, required=True)
    s.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the config's)")
    s.add_argument("--out", required=True)
    s.add_argument("--also", action="append", default=[], metavar="STEPS:WARMUP:OUT",
                   help="another run in this process after the first (repeatable)")
    s.add_argument("--check-gradients", default=None, metavar="JSON",
                   help="first: fla's and our bf16 gradients against our fp32 model, into JSON")
    s.add_argument("--gradient-tokens", type=int, default=4096)
    s.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a setting of the prepared config changed for these runs (repeatable)")
    s = sub.add_parser("spikes")
    s.add_argument("runs", nargs="+")
    s.add_argument("--rise", type=float, default=0.5, help="a rise over the step before: a spike")
    s.add_argument("--last", type=int, default=10)
    s.add_argument("--from-step", type=int, default=10, help="first step of the correlated loss changes")
    s.add_argument("--out", default=None)
    s.add_argument("--png", default=None)
    s.add_argument("--title", default=None)
    s = sub.add_parser("compare")
    s.add_argument("ours")
    s.add_argument("fla")
    s.add_argument("--last", type=int, default=100, help="steps whose mean loss is compared")
    s.add_argument("--settle", type=int, default=50, help="steps after which every step is compared")
    s.add_argument("--mean-tol", type=float, default=0.02)
    s.add_argument("--step-tol", type=float, default=0.15)
    s.add_argument("--out", default=None)
    s.add_argument("--png", default=None)
    s.add_argument("--title", default=None)
    args = p.parse_args(argv)
    if args.command in ("compare", "spikes"):
        return {"compare": compare, "spikes": spikes}[args.command](args)
    {"prepare": prepare, "train": train_side}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
