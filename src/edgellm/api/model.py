"""The Python API: `Model` (made by `edgellm.load`, api/loader.py): generate / stream / chat."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from edgellm.extras import inference, torch

from edgellm.tokenizer.chat.template import ChatTemplate
from edgellm.tokenizer.chat.messages import validate_tools
from edgellm.generation.constrain import Constraint, GrammarState, json_schema
from edgellm.generation.constrain.tools import tool_request
from edgellm.tokenizer.load import load_tokenizer
from edgellm.io.gguf import GGUFFile
from edgellm.io.pack import pack_cache_for
from edgellm.memory import return_freed_heap
from edgellm.errors import ContextOverflow, DraftMismatch, InvalidRequest, UnsupportedModel
from edgellm.generation import Completion, GenerationEvent, SamplingParams, stream_generate
from edgellm.generation.drafters import Drafter, DraftModel, GrammarForced, NoDraft, PromptLookup, best_self_draft, early_exit_agreement
from edgellm.generation.generator import Generation
from edgellm.generation.passes import hidden_states, prefill, prefill_chunk, verify, warm_rows
from edgellm.generation.speculative import SpeculationCosts
from edgellm.generation.sampling import GREEDY_BELOW, Sampler
from edgellm.kv import KVConfig, KVManager, kv_bytes_per_token
from edgellm.kv.persist import load_prefix, save_prefix
from edgellm.lora import Adapter, AdapterSet
from edgellm.models import build_model, first_layers, layer_specs

Message = dict[str, str]
SPECULATIVE = ("lookup", "draft", "self")  # drafters (generation/drafters.py); None / "off": plain decoding


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    name: str
    file_bytes: int
    parameters: int
    tensor_types: dict[str, int]  # GGML type name -> tensor count
    context_length: int
    kv_bytes_per_token: int  # K and V at the default KV precision (f16) over the layers that grow with the context

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def describe(source: GGUFFile) -> ModelInfo:
    """What `edgellm info` shows; reads metadata and tensor infos only."""
    meta, arch = source.metadata, source.metadata.get("general.architecture", "?")
    return ModelInfo(
        path=str(source.path), architecture=arch, name=str(meta.get("general.name", "")),
        file_bytes=source.file_size,
        parameters=sum(t.n_elements for t in source.tensors.values()),
        tensor_types=dict(Counter(t.type_name for t in source.tensors.values()).most_common()),
        context_length=int(meta.get(f"{arch}.context_length", 0)),
        # the planner's formula: sliding-window layers hold a fixed ring, not a per-token cost
        kv_bytes_per_token=kv_bytes_per_token(layer_specs(meta), KVConfig()),
    )


class Model:
    """A loaded model: weights mapped from the file, tokenizer and chat template from its metadata."""

    def __init__(self, source: GGUFFile, mode: str = "fast", context_length: int | None = None,
                 kv: KVConfig | None = None, speculative: str | None = None):
        self.speculative = _speculative_kind(speculative)  # the default for every generation
        self.draft: Model | None = None  # for speculative="draft" (attach_draft)
        self._owns_draft = False  # load() loaded it: close() closes it too
        self.self_draft_layers: int | None = None  # for speculative="self"; None: chosen by measurement
        self.self_draft_agreement: dict[int, float] | None = None  # that measurement (first layers -> agreement)
        self._self_draft: tuple[int, Any, KVManager] | None = None
        self._costs: dict[str, SpeculationCosts] = {}  # per drafter kind (generation/speculative.py)
        self._rows_warm = False  # warm_rows done
        self.source, self.path = source, Path(source.path)
        self.tokenizer = load_tokenizer(source)
        return_freed_heap()  # reading a tokenizer.json (HF folders, quantized files) leaves freed heap behind
        self.template = ChatTemplate.from_metadata(source.metadata, self.tokenizer)
        packed = self._pack_cache = pack_cache_for(source.path, mode)
        self.net = build_model(source, self.tokenizer.vocab_size, mode, packed, context_length)
        if packed is not None:
            packed.save_behind()
        fingerprint = weights_fingerprint(source)
        source.drop_pages()
        self.config = self.net.config
        self.context_length = min(context_length or self.config.context_length, self.config.context_length)
        self.info = describe(source)
        # The salt keeps cached prefixes (and saved KV files) of one model from ever serving another,
        # even a fine-tune of the same name and size.
        salt = f"{self.info.name}|{self.info.file_bytes}|{fingerprint}|{mode}"
        self.kv = KVManager(self.net.cache_specs(), kv or KVConfig.for_mode(mode), self.context_length, salt=salt)
        self._message_overhead: int | None = None
        # LoRA adapters over this base, picked per generation (adapter=NAME); int8 rows where the native layers read them
        self.adapters = AdapterSet(self.config, "int8" if mode == "fast" else "float32", self.kv)

    def load_adapter(self, path: str | Path, name: str | None = None, scale: float = 1.0,
                     charge: bool = True) -> Adapter:
        """Make a LoRA adapter (a PEFT folder or a GGUF LoRA) resident over this model as `name`;
        generations pick it with adapter=name. `scale` multiplies its alpha / rank. Under a
        memory budget its bytes come off the KV's (charge=False: the plan already paid for it)."""
        return self.adapters.load(path, name, scale, charge)

    def unload_adapter(self, name: str) -> None:
        """New generations can no longer pick `name`; running ones finish under it."""
        self.adapters.unload(name)

    # -- generation ----------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], **sampling: Any) -> Iterator[GenerationEvent]:
        """TokenEvents as tokens are generated, then one Completion. Sampling keywords are
        SamplingParams fields (temperature, top_k, top_p, min_p, repetition_penalty, seed,
        max_tokens, stop), `speculative`, a constraint on the output: `schema` (a JSON
        schema dict or a pydantic model; Completion.parsed holds the object) or `constraint`
        (edgellm.generation.constrain: json_schema, any_json, choice, regex, grammar), and `adapter` (the
        name of a resident LoRA adapter, load_adapter)."""
        return self._stream_ids(self._ids(prompt), sampling)

    def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        return last_completion(self.stream(prompt, **sampling))

    def chat(self, messages: Sequence[Message], *, stream: bool = False, tools: Sequence[dict] | None = None,
             tool_choice: str | dict = "auto", parallel_tool_calls: bool = True, **sampling: Any):
        """Render the conversation with the model's chat template and answer it. Messages may
        carry OpenAI tool calls and tool results; `tools`: OpenAI tool definitions (a template
        without tools gets them described by edgellm). With tools, the answer is either valid
        calls (Completion.tool_calls, finish_reason "tool_calls") or, for tool_choice "auto",
        plain text; "required" or {"type": "function", "function": {"name": ...}} force calls."""
        fmt = self.template.tool_format
        shown, calling = tool_request(validate_tools(tools), tool_choice, fmt, parallel_tool_calls)
        asked = self._constraint(sampling)
        if calling is not None and asked is not None:
            raise InvalidRequest("tools and a schema or constraint cannot constrain one answer")
        constraint = calling or asked
        events = self._stream_ids(self.chat_ids(messages, shown, constraint), {**sampling, "constraint": constraint})
        if stream:
            return events  # tool_calls.ToolCallStream(fmt) reads calls out of the streamed text
        done = last_completion(events)
        calls = fmt.parse(done.text) if calling is not None and done.constraint_met else None
        return replace(done, finish_reason="tool_calls", tool_calls=calls) if calls else done

    def _stream_ids(self, ids: list[int], sampling: dict[str, Any]) -> Iterator[GenerationEvent]:
        grammar = self._grammar(self._constraint(sampling))
        options = self._options(adapter=sampling.pop("adapter", None))
        params, drafter, costs = self._decoding(sampling, grammar, options["kv"].adapter)
        return stream_generate(self.net, ids, params, drafter=drafter, costs=costs, grammar=grammar, **options)

    def _decoding(self, sampling: dict[str, Any], grammar: GrammarState | None = None, adapter: Adapter | None = None,
                  ) -> tuple[SamplingParams, Drafter | None, SpeculationCosts | None]:
        """Sampling keywords (and `speculative`, default the model's) -> the sampling parameters,
        a fresh drafter (None: plain decoding) and the costs its kind measured before. Under a
        constraint the grammar's forced tokens are guessed too, unless speculative is "off"."""
        requested = sampling.pop("speculative", self.speculative)
        kind = _speculative_kind(requested)
        params = _params(sampling)
        vocabulary = self.tokenizer.vocab_size
        if any(not 0 <= token < vocabulary for token, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias names a token outside the vocabulary (0..{vocabulary - 1})")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            return params, None, None  # each token's own logits: plain decoding
        drafter = self.drafter(kind, params, adapter)
        if grammar is not None and requested != "off":
            return params, GrammarForced(grammar, drafter), None
        return params, drafter, self._speculation_costs(kind)

    def _grammar(self, constraint: Constraint | None) -> GrammarState | None:
        """A fresh grammar state for one generation under `constraint`; None: unconstrained."""
        return None if constraint is None else GrammarState(constraint, self.tokenizer)

    @staticmethod
    def _constraint(sampling: dict[str, Any]) -> Constraint | None:
        """Pops `constraint` or `schema` (a JSON schema or pydantic model) off the keywords."""
        constraint, schema = sampling.pop("constraint", None), sampling.pop("schema", None)
        if schema is not None:
            if constraint is not None:
                raise InvalidRequest("give schema or constraint, not both")
            constraint = json_schema(schema)
        if constraint is not None and not isinstance(constraint, Constraint):
            raise InvalidRequest(f"constraint must be an edgellm.generation.constrain.Constraint, got {type(constraint).__name__}")
        return constraint

    def chat_ids(self, messages: Sequence[Message], tools: list[dict] | None = None,
                 constraint: Constraint | None = None) -> list[int]:
        """A conversation's prompt ids: the chat template with the tools, and what the answer's
        constraint asks of it said in a system note (a small model must know the keys a
        schema wants, as OpenAI tells its models)."""
        note = None if constraint is None else constraint.instructions
        return self.template.encode_chat(messages, tools=tools, note=note)

    # -- speculative decoding ---------------------------------------------------------------

    def attach_draft(self, draft: Model, owned: bool = False) -> None:
        """Use `draft` for speculative="draft"; it must share this model's vocabulary. `owned`:
        close it with this model."""
        mine, theirs = self.tokenizer, draft.tokenizer
        same = mine.vocab_size == theirs.vocab_size and all(
            mine.token_bytes(i) == theirs.token_bytes(i) for i in range(mine.vocab_size))
        if not same:
            raise DraftMismatch(f"the draft {draft.path.name} ({theirs!r}) does not share the vocabulary of "
                                f"{self.path.name} ({mine!r}): its guesses would be other tokens")
        self.draft, self._owns_draft = draft, owned

    def drafter(self, kind: str | None, params: SamplingParams, adapter: Adapter | None = None) -> Drafter | None:
        """A fresh drafter of `kind` for one generation (None: plain decoding); the
        self-speculative draft runs under the generation's LoRA adapter too (its first layers)."""
        if kind is None:
            return None
        if not self._rows_warm:
            warm_rows(self.net, self.kv)
            self._rows_warm = True
        if kind == "lookup":
            return PromptLookup()
        sampler = None
        if params.temperature >= GREEDY_BELOW:  # the draft samples too, from its own stream of numbers
            seed = None if params.seed is None else (params.seed + 1) % 2**63
            sampler = Sampler(replace(params, seed=seed))
        if kind == "draft":
            if self.draft is None:
                raise InvalidRequest("speculative='draft' needs a draft model: load(..., draft=PATH) or --draft PATH")
            return DraftModel(self.draft.net, self.draft.kv, sampler, "draft")
        n = self.self_draft_layers or self._measured_self_draft_layers()
        if n is None:
            return NoDraft("self")  # measured not to pay on this model: plain decoding
        net, kv = self._self_draft_parts(n)
        return DraftModel(net, kv.for_adapter(adapter), sampler, "self")

    def forget_speculation_costs(self) -> None:
        """Let the next generations measure speculation afresh (the machine's load changed, or
        a test wants every generation to speculate from its start)."""
        self._costs.clear()

    def _speculation_costs(self, kind: str | None) -> SpeculationCosts | None:
        """What generations measured with this kind of drafter on this model, shared between them."""
        return None if kind is None else self._costs.setdefault(kind, SpeculationCosts())

    def _measured_self_draft_layers(self) -> int | None:
        """How many first layers draft best, from how often their early exit agrees with the
        whole model on edgellm's calibration text (measured once, ~1-3 s); None if no count pays."""
        if self.self_draft_agreement is None:
            from importlib import resources

            text = resources.files("edgellm").joinpath("data/calibration.txt").read_text(encoding="utf-8")
            n_layers = self.config.n_layers
            candidates = sorted({max(1, n_layers // 2), max(1, 3 * n_layers // 4), max(1, n_layers - 2), n_layers - 1})
            self.self_draft_agreement = early_exit_agreement(self.net, self.kv, self.tokenizer.encode(text)[:128],
                                                             [n for n in candidates if 0 < n < n_layers])
        return best_self_draft(self.self_draft_agreement, self.config.n_layers)[0]

    def _self_draft_parts(self, n: int) -> tuple[Any, KVManager]:
        """The first n layers of this model as a draft, and a KV manager of their own (kept)."""
        if self._self_draft is None or self._self_draft[0] != n:
            net = first_layers(self.net, n)
            kv = KVManager(net.cache_specs(), self.kv.config, self.context_length, salt=f"{self.kv.salt}|first{n}")
            self._self_draft = (n, net, kv)
        return self._self_draft[1], self._self_draft[2]

    def generation(self, prompt, *, chat: bool = False, kv: str | None = None, tools: list[dict] | None = None,
                   **sampling: Any) -> Generation:
        """A step-wise generation (prefill / accept) for engines that batch decode steps;
        `kv` picks this request's KV precision ("int8", "f16:int4"; default the model's),
        served from the model's one block pool and budget; `speculative` as in generate (an
        engine speculates when the generation decodes alone)."""
        constraint = self._constraint(sampling)
        ids = self.chat_ids(prompt, tools, constraint) if chat else self._ids(prompt)
        grammar = self._grammar(constraint)
        options = self._options(kv, sampling.pop("adapter", None))
        params, drafter, costs = self._decoding(sampling, grammar, options["kv"].adapter)
        generation = Generation(self.net, ids, params, grammar=grammar, **options)
        if drafter is not None:
            generation.speculate(drafter, costs)
        return generation

    def continuation_logprobs(self, prompt: str | Sequence[int], continuations: Sequence[Sequence[int]],
                              adapter: str | Adapter | None = None) -> list[float]:
        """Log-probability of each token sequence in `continuations` right after `prompt` (the
        sum over its tokens): the prompt runs once (or comes from the prefix cache), each
        continuation from its KV, trimmed after. For scoring labels (tasks.classify)."""
        ids = self._ids(prompt)
        seq, reused = self.kv.for_adapter(self.adapters.get(adapter)).new_sequence(ids)
        scores = []
        try:
            with inference():
                last = prefill(self.net, seq, ids[reused:], prefill_chunk(self.kv))
                for tokens in map(list, continuations):
                    if not tokens:
                        raise InvalidRequest("a continuation to score is empty")
                    rows = [last[None]] + ([verify(self.net, seq, tokens[:-1])] if len(tokens) > 1 else [])
                    scores.append(_logprob(np.concatenate(rows), tokens))
                    seq.trim(len(tokens) - 1)
        finally:
            seq.release()
        return scores

    def embed(self, inputs: Sequence[str | Sequence[int]], *, pooling: str | None = None, normalize: bool = True,
              ) -> tuple[np.ndarray, int]:
        """One vector per input (a text or token ids): the last layer's hidden states after the final
        norm, pooled by `pooling` ("mean" over the tokens, "last" token, or "first"; default the
        GGUF's pooling_type, else mean) and L2-normalized. Returns (vectors (n, hidden) fp32,
        tokens read). Each input runs in a fresh sequence (no prefix reuse: a cached prefix holds
        no hidden states)."""
        pooling = pooling or self.pooling
        if pooling not in POOLINGS:
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        vectors, read = [], 0
        for item in inputs:
            ids = self._ids(item)
            if not ids:
                raise InvalidRequest("an input to embed is empty")
            if len(ids) > self.context_length:
                raise ContextOverflow(len(ids), self.context_length)
            states = self._hidden(ids)
            vectors.append(_pool(_final_norm(self.net, states), pooling))
            read += len(ids)
        out = np.stack(vectors).astype(np.float32)
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out, read

    @property
    def pooling(self) -> str:
        """The pooling the file asks for (llama.cpp's {arch}.pooling_type), else mean."""
        arch = self.source.metadata.get("general.architecture", "")
        return {1: "mean", 2: "first", 3: "last"}.get(self.source.metadata.get(f"{arch}.pooling_type"), "mean")

    def _hidden(self, ids: list[int]) -> np.ndarray:
        seq, _ = self.kv.new_sequence([])
        try:
            with inference():
                states = hidden_states(self.net, seq, ids)
        finally:
            seq.release()
        if states is None:
            raise UnsupportedModel("embeddings need the native layers (fast mode, a family they run)")
        return states

    def kv_for(self, precision: str | None = None) -> KVManager:
        """The KV manager of a precision ("int8", "f16:int4"; None: the model's default)."""
        return self.kv if precision is None else self.kv.for_precision(precision)

    def _options(self, kv: str | None = None, adapter: str | Adapter | None = None) -> dict[str, Any]:
        manager = self.kv_for(kv).for_adapter(self.adapters.get(adapter))
        return dict(token_bytes=self.tokenizer.token_bytes, eos_ids=self.tokenizer.eos_ids, kv=manager,
                    context_length=self.context_length)

    def logits(self, ids: Sequence[int], kv: KVConfig | None = None, adapter: str | Adapter | None = None,
               ) -> torch.Tensor:
        """Teacher-forced logits (T, V) for a token sequence (evaluation, parity checks),
        computed in one pass over a fresh cache of the given (default: this model's) KV config,
        under a resident adapter if one is named."""
        manager = self.kv if kv is None else KVManager(self.net.cache_specs(), kv, self.context_length)
        manager = manager.for_adapter(self.adapters.get(adapter))
        seq, _ = manager.new_sequence()
        try:
            seq.prepare(len(ids))
            with inference():
                return self.net(np.array([list(ids)], dtype=np.int64), seq)[0]
        finally:
            seq.release()

    # -- the prefix cache's disk tier ------------------------------------------------------

    def save_prefix(self, prompt: str | Sequence[int] | Sequence[Message], path: str | Path,
                    note: str | None = None) -> int:
        """Compute a prompt's KV (a system prompt, a document, a conversation so far) and save it;
        returns the number of tokens saved (whole blocks). Needs the prefix cache (on unless
        prefix_cache_bytes=0). `note`: text kept in the file (kv.persist.saved_note)."""
        ids = self._ids(prompt)
        last_completion(self._stream_ids(ids, {"max_tokens": 0}))  # prefill; finished blocks are remembered
        return save_prefix(self.kv, ids, path, note)

    def load_prefix(self, path: str | Path) -> int:
        """Load a saved prefix into the prefix cache; later prompts starting with it skip its
        prefill. Returns its token count; another model's file raises KVStateMismatch."""
        return len(load_prefix(self.kv, path))

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[Message]) -> list[int]:
        """Token ids of a text (encoded as is), of ids, or of a whole conversation (no
        generation prompt)."""
        return self._ids(prompt)

    def turn_tokens(self, messages: Sequence[Message]) -> int:
        """About how many prompt tokens these messages take in a conversation: their text's
        tokens plus the template's per-message tokens (measured once)."""
        if self._message_overhead is None:
            one = [{"role": "user", "content": "a"}]
            three = one + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "a"}]
            extra = len(self.template.encode_chat(three)) - len(self.template.encode_chat(one))
            self._message_overhead = max(0, extra // 2 - 1)
        encode = self.tokenizer.encode
        return sum(len(encode(m["content"], add_special_tokens=False)) + self._message_overhead for m in messages)

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.template.encode_chat(prompt, add_generation_prompt=False)
        ids, vocabulary = [int(i) for i in prompt], self.tokenizer.vocab_size
        if any(not 0 <= i < vocabulary for i in ids):
            raise InvalidRequest(f"a prompt token id is outside the vocabulary (0..{vocabulary - 1})")
        return ids

    def close(self) -> None:
        """Drop the weights and release the file mapping (and those of a draft load() loaded)."""
        if self._owns_draft:
            self.draft.close()
            self._owns_draft = False
        if self._pack_cache is not None:
            self._pack_cache.wait()
        self.net = None
        self.source.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _speculative_kind(kind: str | None) -> str | None:
    if kind in (None, "", "off"):
        return None
    if kind not in SPECULATIVE:
        raise InvalidRequest(f"speculative must be one of {', '.join(SPECULATIVE)} or off, got {kind!r}")
    return kind


POOLINGS = ("mean", "last", "first")
FINGERPRINT_BYTES = 4096


def weights_fingerprint(source) -> str:
    """A digest of each tensor's first and last 4 KiB (a few MB of reads for a whole GGUF): two files
    of one name and size but other weights differ in it. "" for other sources."""
    if not isinstance(source, GGUFFile):
        return ""
    digest = hashlib.sha256()
    for name in sorted(source.tensors):
        raw = source.raw(name)
        digest.update(name.encode())
        digest.update(raw[:FINGERPRINT_BYTES].tobytes())
        digest.update(raw[-FINGERPRINT_BYTES:].tobytes())
    return digest.hexdigest()[:16]


def _final_norm(net, states: np.ndarray) -> np.ndarray:
    """The model's final RMSNorm over hidden states (T, hidden)."""
    norm = net.norm
    x = states.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + norm.eps) * np.asarray(norm.weight, dtype=np.float64)


def _pool(states: np.ndarray, pooling: str) -> np.ndarray:
    return {"mean": lambda: states.mean(axis=0), "last": lambda: states[-1], "first": lambda: states[0]}[pooling]()


def _params(sampling: dict[str, Any]) -> SamplingParams:
    stop = sampling.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    bias = sampling.get("logit_bias") or ()
    bias = tuple(sorted((int(k), float(v)) for k, v in (bias.items() if isinstance(bias, dict) else bias)))
    return SamplingParams(**{**sampling, "stop": stop, "logit_bias": bias})


def last_completion(events: Iterator[GenerationEvent]) -> Completion:
    """Run a stream to its end and return its Completion."""
    for event in events:
        if isinstance(event, Completion):
            return event
    raise RuntimeError("generation ended without a Completion")  # a bug, not bad input


def _logprob(logits: np.ndarray, tokens: list[int]) -> float:
    """The summed log-probability of tokens[i] under row i's softmax (fp64)."""
    rows = logits.astype(np.float64)
    top = rows.max(-1, keepdims=True)
    log_totals = np.log(np.exp(rows - top).sum(-1)) + top[:, 0]
    return float((rows[np.arange(len(tokens)), tokens] - log_totals).sum())
