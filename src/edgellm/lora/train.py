"""Training a LoRA adapter on the device: the base frozen, the adapter's A and B in fp32, PyTorch
autograd through the model's own layers (the same forward that serves it, so what is trained is
what runs), loss on the assistant's tokens only (the chat template decides where they are).

The base runs in exact mode: its weights are the quantized file's values dequantized to fp32
(the values a served model computes with, without a backward pass through quantized kernels,
and fp32 because bf16 matmuls are ~90x slower on CPUs without native bf16). Checkpoints
(adapter + optimizer state) let a stopped run resume where it was; the result is a PEFT folder."""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from edgellm.tokenizer.chat.messages import validate_messages
from edgellm.errors import InvalidRequest
from edgellm.kv.cache import CAUSAL, SlidingCausal
from edgellm.lora.adapter import PROJECTIONS, Adapter, LoRAPair, projection_shapes
from edgellm.lora.peft_io import HF_MODULES, save_peft

Progress = Callable[["StepReport"], None]


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = PROJECTIONS
    epochs: int = 1
    max_steps: int | None = None  # stop earlier than the epochs would
    batch: int = 4  # examples per optimizer step (their gradients summed, one at a time: little memory)
    lr: float = 1e-3
    max_len: int = 512  # longer examples are cut
    checkpoint_every: int = 50  # steps
    seed: int = 0

    def check(self) -> None:
        if not 1 <= self.rank <= 256:
            raise InvalidRequest(f"rank must be 1..256, got {self.rank}")
        unknown = set(self.targets) - set(PROJECTIONS)
        if unknown or not self.targets:
            raise InvalidRequest(f"targets must be among {', '.join(PROJECTIONS)}, got {', '.join(self.targets)}")
        if self.epochs < 1 or self.batch < 1 or self.lr <= 0 or self.max_len < 8 or self.checkpoint_every < 1:
            raise InvalidRequest("epochs, batch and checkpoint_every must be >= 1, lr > 0, max_len >= 8")


@dataclass(frozen=True)
class Example:
    ids: list[int]
    learn: list[bool]  # learn[j]: token j is the assistant's (predicting it counts in the loss)


@dataclass(frozen=True)
class StepReport:
    step: int
    total: int
    loss: float
    tokens_per_s: float  # all tokens through forward and backward


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def read_examples(path: str | Path, template, max_len: int) -> list[Example]:
    """A JSONL file of {"messages": [...]} conversations (OpenAI's fine-tuning format) or
    {"prompt": ..., "completion": ...} pairs, as token ids with the assistant's tokens marked."""
    examples = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise InvalidRequest(f"cannot read training data {path}: {error.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"] if "messages" in record else [
                {"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
            validate_messages(messages)
        except (ValueError, KeyError, TypeError, InvalidRequest) as error:
            raise InvalidRequest(f"{path}:{number}: not a conversation ({error})") from None
        example = chat_example(template, messages, max_len)
        if not any(example.learn):
            raise InvalidRequest(f"{path}:{number}: no assistant tokens to learn from within the first {max_len} "
                                 f"tokens (is there an assistant message? --max-len may be too short)")
        examples.append(example)
    if not examples:
        raise InvalidRequest(f"{path} holds no examples")
    return examples


def chat_example(template, messages: Sequence[dict], max_len: int) -> Example:
    """The conversation's ids with each assistant turn's tokens marked: a turn is what its
    rendering adds after the prompt that asks for it (its text and end-of-turn token)."""
    ids = template.encode_chat(list(messages), add_generation_prompt=False)
    learn = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(template.encode_chat(list(messages[:i]), add_generation_prompt=True))
        end = len(template.encode_chat(list(messages[:i + 1]), add_generation_prompt=False))
        learn[start:end] = [True] * (min(end, len(ids)) - start)
    return Example(ids[:max_len], learn[:max_len])


class _Passthrough:
    """One layer's "cache" for a whole sequence at once: its keys are the sequence's own."""

    def __init__(self, window: int | None):
        self.window, self.offset = window, 0

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        t = k.shape[2]
        return k, v, CAUSAL if self.window is None or t <= self.window else SlidingCausal(self.window)


class WholeSequence:
    """The caches of one training forward (nothing stored), carrying the adapter being trained."""

    def __init__(self, specs, adapter: Adapter):
        self.layers = [_Passthrough(spec.window) for spec in specs]
        self.adapter = adapter

    def positions(self, t: int) -> torch.Tensor:
        return torch.arange(t)

    def __iter__(self) -> Iterator[_Passthrough]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


class LoRATrainer:
    """A fresh adapter (A random, B zero: it starts as the base) over a frozen exact-mode model."""

    def __init__(self, model, config: TrainConfig):
        if model.net.mode != "exact":
            raise InvalidRequest("training runs on a model loaded with mode='exact' (fp32 values of its weights)")
        config.check()
        self.model, self.config, self.net = model, config, model.net  # its weights are plain buffers: frozen
        torch.manual_seed(config.seed)
        shapes = projection_shapes(model.config)
        self.params: dict[tuple[int, str], tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        for layer in range(model.config.n_layers):
            for part in config.targets:
                out_dim, in_dim = shapes[part]
                a = torch.empty(config.rank, in_dim).uniform_(-in_dim ** -0.5, in_dim ** -0.5)  # PEFT's init
                self.params[layer, part] = (torch.nn.Parameter(a), torch.nn.Parameter(torch.zeros(config.rank, out_dim)))
        self.adapter = Adapter("training", model.path, config.rank, config.alpha / config.rank,
                               {k: LoRAPair(a, b_t) for k, (a, b_t) in self.params.items()},
                               {p: out for p, (out, _) in shapes.items()}, "training")
        self.optimizer = torch.optim.AdamW([t for pair in self.params.values() for t in pair], lr=config.lr,
                                           weight_decay=0.0)
        self.state = TrainState()

    def loss(self, example: Example) -> torch.Tensor:
        """Mean cross-entropy of the assistant's tokens, each predicted from the ones before."""
        ids = torch.tensor([example.ids])
        logits = self.net(ids, WholeSequence(self.net.cache_specs(), self.adapter))[0, :-1]
        learn = torch.tensor(example.learn[1:])
        return torch.nn.functional.cross_entropy(logits[learn], ids[0, 1:][learn])

    def step(self, batch: Sequence[Example]) -> float:
        """One optimizer step over `batch` (gradients of each example's mean loss, averaged)."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for example in batch:
            loss = self.loss(example) / len(batch)
            loss.backward()
            total += float(loss.detach())
        for group in self.optimizer.param_groups:  # a short linear warm-up steadies the first steps
            group["lr"] = self.config.lr * min(1.0, (self.state.step + 1) / 10)
        self.optimizer.step()
        self.state.step += 1
        self.state.losses.append(total)
        self.state.tokens += sum(len(e.ids) for e in batch)
        self.state.seconds += time.perf_counter() - start
        return total

    # -- saving and resuming -------------------------------------------------------------

    def save(self, out: Path) -> Path:
        """The adapter as a PEFT folder at `out`."""
        pairs = {k: (a, b_t.T) for k, (a, b_t) in self.params.items()}
        return save_peft(out, pairs, self.config.rank, self.config.alpha, self.model.path.name)

    def checkpoint(self, out: Path) -> Path:
        """The adapter and everything resuming needs, in out/checkpoints/step-N."""
        folder = out / "checkpoints" / f"step-{self.state.step:06d}"
        state = {"optimizer": self.optimizer.state_dict(), "state": asdict(self.state), "config": asdict(self.config)}
        self.save(folder)
        torch.save(state, folder / "trainer_state.pt.partial")
        (folder / "trainer_state.pt.partial").replace(folder / "trainer_state.pt")
        return folder

    def resume(self, out: Path) -> bool:
        """Continue from the newest checkpoint under `out` (False: there is none)."""
        from safetensors.torch import load_file

        done = sorted(p for p in (out / "checkpoints").glob("step-*") if (p / "trainer_state.pt").is_file())
        if not done:
            return False
        state = torch.load(done[-1] / "trainer_state.pt", weights_only=False)
        if state["config"] != asdict(self.config):
            raise InvalidRequest(f"{done[-1]} was trained with other settings: {state['config']}")
        tensors = load_file(str(done[-1] / "adapter_model.safetensors"))
        with torch.no_grad():
            for (layer, part), (a, b_t) in self.params.items():
                key = f"base_model.model.model.layers.{layer}.{HF_MODULES[part]}"
                a.copy_(tensors[f"{key}.lora_A.weight"])
                b_t.copy_(tensors[f"{key}.lora_B.weight"].T)
        self.optimizer.load_state_dict(state["optimizer"])
        self.state = TrainState(**state["state"])
        return True


def schedule(n_examples: int, config: TrainConfig) -> list[list[int]]:
    """Example indices of every optimizer step: each epoch shuffled (by seed and epoch, so a
    resumed run takes the same steps), cut into batches."""
    steps = []
    for epoch in range(config.epochs):
        order = list(range(n_examples))
        random.Random(config.seed * 1000 + epoch).shuffle(order)
        steps += [order[i:i + config.batch] for i in range(0, n_examples, config.batch)]
    return steps[:config.max_steps] if config.max_steps else steps


def train(model, examples: Sequence[Example], config: TrainConfig, out: str | Path, *, resume: bool = False,
          progress: Progress | None = None) -> TrainState:
    """Train an adapter on `examples` into the PEFT folder `out` (checkpoints in out/checkpoints;
    `resume`: continue from the newest). Returns the losses and speed."""
    out = Path(out)
    trainer = LoRATrainer(model, config)
    if resume:
        trainer.resume(out)
    steps = schedule(len(examples), config)
    for batch in steps[trainer.state.step:]:
        loss = trainer.step([examples[i] for i in batch])
        if trainer.state.step % config.checkpoint_every == 0 and trainer.state.step < len(steps):
            trainer.checkpoint(out)
        if progress is not None:
            progress(StepReport(trainer.state.step, len(steps), loss, trainer.state.tokens_per_s))
    trainer.save(out)
    (out / "loss.json").write_text(json.dumps(asdict(trainer.state) | {"tokens_per_s": trainer.state.tokens_per_s}))
    return trainer.state


def smoothed(losses: Sequence[float], window: int = 10) -> list[float]:
    """A running mean, for the loss plot."""
    return [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]


def plot_losses(losses: Sequence[float], path: Path) -> Path | None:
    """loss.png (steps on x, the loss and its running mean); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, alpha=0.35, label="loss")
    ax.plot(steps, smoothed(losses), label="running mean (10 steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (assistant tokens)")
    ax.set_yscale("log" if min(losses, default=1) > 0 and max(losses, default=1) / max(min(losses), 1e-9) > 20 else "linear")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

