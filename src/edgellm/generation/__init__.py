"""Logits to text: sampling, stop strings, UTF-8-safe streaming, typed events."""
from edgellm.generation.events import Completion, GenerationEvent, Timings, TokenEvent
from edgellm.generation.generator import stream_generate
from edgellm.generation.sampling import Sampler, SamplingParams

__all__ = ["Completion", "GenerationEvent", "Sampler", "SamplingParams", "Timings", "TokenEvent",
           "stream_generate"]
