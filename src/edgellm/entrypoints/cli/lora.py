"""`edgellm lora train | merge`: an adapter trained on this machine from a chat JSONL file, and a
base + adapter written as one model."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgellm.registry import DEFAULT_MODEL


def add_parsers(sub) -> None:
    lora = sub.add_parser("lora", help="LoRA adapters: train one on this machine, or merge one into its base")
    actions = lora.add_subparsers(dest="lora_command", required=True)

    train = actions.add_parser("train", help="train a LoRA adapter (PEFT format) on chat examples")
    train.add_argument("--data", required=True, help='JSONL: {"messages": [...]} or {"prompt": ..., "completion": ...}')
    train.add_argument("--out", required=True, help="the adapter folder (PEFT format; checkpoints inside)")
    train.add_argument("-m", "--model", default=DEFAULT_MODEL, help="the base model (name or path)")
    train.add_argument("--rank", type=int, default=8)
    train.add_argument("--alpha", type=float, default=None, help="scale numerator (default: 2 x rank)")
    train.add_argument("--targets", default="q,k,v,o,gate,up,down", help="projections to adapt")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    train.add_argument("--batch", type=int, default=4, help="examples per optimizer step")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--max-len", type=int, default=512, help="tokens per example (longer ones are cut)")
    train.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None)
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    train.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    merge = actions.add_parser("merge", help="write base + adapter as one model (a Hugging Face folder)")
    merge.add_argument("adapter", help="a PEFT folder or a GGUF LoRA")
    merge.add_argument("--out", required=True, help="the merged model's folder (must not exist or be empty)")
    merge.add_argument("-m", "--model", default=DEFAULT_MODEL, help="the base model (name or path)")
    merge.add_argument("--scale", type=float, default=1.0, help="multiplies the adapter's alpha / rank")
    merge.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="bf16")
    merge.add_argument("-q", "--quiet", action="store_true")
    merge.set_defaults(func=cmd_merge)


def cmd_train(args: argparse.Namespace) -> int:
    from edgellm.api.loader import load
    from edgellm.lora.train import TrainConfig, plot_losses, read_examples, train

    config = TrainConfig(rank=args.rank, alpha=args.alpha if args.alpha is not None else 2.0 * args.rank,
                         targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()), epochs=args.epochs,
                         max_steps=args.steps, batch=args.batch, lr=args.lr, max_len=args.max_len,
                         checkpoint_every=args.checkpoint_every, seed=args.seed)
    config.check()  # bad flags fail before the model loads
    out = Path(args.out)
    with load(args.model, mode="exact", threads=args.threads) as model:
        examples = read_examples(args.data, model.template, config.max_len)
        with _train_bar(not args.quiet) as report:
            state = train(model, examples, config, out, resume=args.resume, progress=report)
    plot = plot_losses(state.losses, out / "loss.png")
    print(json.dumps({"out": str(out), "steps": state.step, "examples": len(examples),
                      "final_loss": round(sum(state.losses[-5:]) / max(1, len(state.losses[-5:])), 4),
                      "train_tokens_per_s": round(state.tokens_per_s, 1),
                      "plot": str(plot) if plot else "(pip install matplotlib for loss.png)"}))
    return 0


class _train_bar:
    """A rich progress bar with the loss and tokens/s (None when off)."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.task = enabled, None, None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]:.3f}  {task.fields[speed]:.0f} tok/s"),
                            TimeRemainingColumn(), console=Console(stderr=True))
        self.bar.__enter__()
        return self.report

    def report(self, step) -> None:
        if self.task is None:
            self.task = self.bar.add_task("train", total=step.total, loss=step.loss, speed=step.tokens_per_s)
        self.bar.update(self.task, completed=step.step, loss=step.loss, speed=step.tokens_per_s)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def cmd_merge(args: argparse.Namespace) -> int:
    import torch

    from edgellm.entrypoints.cli.quant import progress_bar
    from edgellm.tools.convert import convert_to_hf
    from edgellm.io import open_model
    from edgellm.lora.adapter import load_adapter
    from edgellm.models import model_config
    from edgellm.store import resolve

    path = resolve(args.model)
    with open_model(path) as source:
        config = model_config(source.metadata)
    adapter = load_adapter(args.adapter, config, scale=args.scale, dtype=torch.float32)
    with progress_bar(not args.quiet) as report:
        out = convert_to_hf(path, args.out, args.dtype, adapter=adapter,
                            progress=(lambda name, done, total: report("merge", done, total)) if report else None)
    print(f"wrote {out}: {args.model} with {Path(args.adapter).name} merged (Hugging Face layout, {args.dtype}); "
          f"edgellm loads it as is, `edgellm quantize {out} OUT.edgellm` makes it one quantized file", file=sys.stderr)
    return 0
